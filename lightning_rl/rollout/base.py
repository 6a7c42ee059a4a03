"""The rollout-engine interface: what every engine (transformers, vLLM, vLLM server) implements.

An engine turns prompt token ids into sampled completions, reports the log-probability it gave to
each sampled token, and accepts new weights from the trainer. Each rollout records the weight
version that produced it, which is what bounded staleness in asynchronous training is checked on.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import re
import threading

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_rl import validation
from lightning_rl.dotted import load_object
from lightning_rl.errors import RecipeError
from lightning_rl.packing.tree import concat_supports


@dataclass(frozen=True)
class SamplingSettings:
    """The recipe's ``sampling:`` group: how completions are sampled (TRL's names). `top_k=0`, `top_p=1.0`,
    `min_p=0.0` and `repetition_penalty=1.0` switch those filters off; every engine here supports all four.

    With a filter on, each sampled token's log-prob is that of the filtered, renormalised distribution it was drawn
    from, and the engine reports its support (the tokens the filters kept) so the trainer scores the same one.

    Args:
        max_new_tokens: tokens sampled per completion (per turn, with tools) at most. TRL: `max_completion_length`.
        temperature: softmax temperature (0: greedy, which GRPO refuses: a prompt's completions would all be one); the
            trainer scores under the same one. TRL: `temperature`.
        top_p: nucleus filter: the smallest set of tokens whose probability reaches it. TRL: `top_p`.
        top_k: keep the k most likely tokens (0: off). TRL: `top_k`.
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0: off). TRL: `min_p`.
        repetition_penalty: CTRL's penalty on tokens already in the prompt or completion (1: off). TRL: the same
            name.
        max_support: the most tokens the filters may keep at one sampled token: the trainer holds each token's
            support, and the vLLM engines report max_support + 1 top log-probs per token to find it (with top_k, at
            most 2 x top_k + 17: top-k keeps the tokens tied with the k-th too), so a wider support (top_p alone at a
            high temperature on a large vocabulary) is refused at run time. top_k bounds it, ties aside.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_support: int = 1024

    def __post_init__(self) -> None:
        validation.positive_int("sampling.max_new_tokens", self.max_new_tokens)
        validation.finite_non_negative("sampling.temperature", self.temperature)
        validation.fraction("sampling.top_p", self.top_p, low_open=True, high_open=False)
        validation.non_negative_int("sampling.top_k", self.top_k)
        validation.fraction("sampling.min_p", self.min_p)
        validation.finite_positive("sampling.repetition_penalty", self.repetition_penalty)
        validation.positive_int("sampling.max_support", self.max_support)
        if self.top_k > self.max_support:
            raise RecipeError(
                f"sampling.max_support={self.max_support} is below sampling.top_k={self.top_k}: every sampled token "
                "would keep more tokens than the trainer holds; raise max_support or lower top_k", "sampling.max_support",
            )

    @property
    def filtered(self) -> bool:
        """Whether a filter truncates the distribution sampled from (greedy sampling has none to replay)."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0)


@dataclass(frozen=True)
class SamplingConfig(SamplingSettings):
    """One generation request's sampling: the recipe's settings, plus what the run sets per request."""

    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Tokens that must never be sampled (an image-text model's image placeholders and markers): removed from the
    # distribution before sampling, and from the log-probs the engine reports.
    suppress_token_ids: tuple[int, ...] = ()


InfraFailure = Literal["engine", "tool_worker", "reward_timeout"]
"""Why a rollout failed for reasons outside the model: the engine ended the sequence without finishing it (vLLM's
``abort``), a tool's worker process died or could not start, a reward call ran past ``reward_timeout_s``."""


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    `completion_ids` holds every token after the prompt. In a multi-turn rollout that includes tool
    outputs the model did not sample: `completion_mask` is False for those, and their `logprobs`
    entry is 0.0. `logprobs[t]` is the engine's log p(completion_ids[t]) under the distribution it was
    drawn from: the temperature-scaled one, without the suppressed tokens and, when a sampling filter
    (top-k, top-p, min-p) is on, restricted to the tokens the filter kept and renormalised over them.
    `support` ([len(completion_ids), K] int32) then holds, per token, the ids the filter kept, padded with
    -1; a row of -1 only (a tool output's token) stands for no restriction. None: no filter was on.

    `token_versions[t]` is the weight version that sampled `completion_ids[t]` (a tool output's token: the version of
    the turn it answers): a completion generated across a weight update holds two or more. `weight_version` is the
    oldest of them, the one staleness is bounded on. None: the whole completion was sampled at `weight_version`.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    group_id: int
    completion_mask: list[bool] | None = None
    finish_reason: str = "length"
    messages: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    # [len(sequence), layers, top_k] the experts the engine routed each token to, per router (router replay);
    # -1 where it routed none (the last token, whose outputs nothing reads). None: not recorded.
    routes: torch.Tensor | None = None
    support: torch.Tensor | None = None
    # Why the rollout failed for reasons outside the model (`InfraFailure`), None if it did not: such a rollout is
    # left out of its group's advantages and of the loss (`rollout/collector.py:without_infra_failures`).
    infra_failure: InfraFailure | None = None
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"rollout of group {self.group_id}: {len(self.logprobs)} log-probs for "
                f"{len(self.completion_ids)} completion tokens"
            )
        if self.completion_mask is None:
            self.completion_mask = [True] * len(self.completion_ids)
        elif len(self.completion_mask) != len(self.completion_ids):
            raise ValueError(
                f"rollout of group {self.group_id}: completion_mask has {len(self.completion_mask)} "
                f"entries for {len(self.completion_ids)} completion tokens"
            )
        if self.token_versions is not None and (
            len(self.token_versions) != len(self.completion_ids) or min(self.token_versions, default=self.weight_version) != self.weight_version
        ):
            raise ValueError(
                f"rollout of group {self.group_id}: {len(self.token_versions)} token versions for {len(self.completion_ids)} "
                f"completion tokens, oldest {min(self.token_versions, default=None)} (want weight_version={self.weight_version})"
            )
        if self.support is not None and (self.support.dim() != 2 or self.support.shape[0] != len(self.completion_ids)):
            raise ValueError(
                f"rollout of group {self.group_id}: support of shape {tuple(self.support.shape)} for "
                f"{len(self.completion_ids)} completion tokens (want [tokens, K])"
            )

        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] != len(self.prompt_ids) + len(self.completion_ids)):
            raise ValueError(
                f"rollout of group {self.group_id}: routes of shape {tuple(self.routes.shape)} for "
                f"{len(self.prompt_ids) + len(self.completion_ids)} tokens (want [tokens, layers, top_k])"
            )

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by completion: the token sequence the trainer packs."""
        return self.prompt_ids + self.completion_ids

    @property
    def loss_mask(self) -> list[bool]:
        """Per token of `sequence`: True where the token was sampled by the model (trained)."""
        assert self.completion_mask is not None
        return [False] * len(self.prompt_ids) + list(self.completion_mask)

    @property
    def sequence_logprobs(self) -> list[float]:
        """Engine log-probs aligned with `sequence` (0.0 on prompt tokens)."""
        return [0.0] * len(self.prompt_ids) + list(self.logprobs)

    @property
    def versions(self) -> list[int]:
        """`token_versions`, or `weight_version` for every completion token without them."""
        return list(self.token_versions) if self.token_versions is not None else [self.weight_version] * len(self.completion_ids)

    @property
    def sequence_support(self) -> torch.Tensor | None:
        """`support` aligned with `sequence` (rows of -1 on prompt tokens), or None without one."""
        return concat_supports([(None, len(self.prompt_ids)), (self.support, len(self.completion_ids))])


def supports_of(kept: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """[tokens, K] int32 ids of the tokens ``kept`` ([tokens, vocab] booleans: what the filters left) marks, padded
    with -1, K the widest row's count; a row wider than ``sampling.max_support`` is refused."""
    counts = kept.sum(-1)
    width = check_support_width(int(counts.max()) if counts.numel() else 0, sampling)
    # A stable sort puts each row's kept ids first, in increasing order.
    ids = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width].to(torch.int32)
    return ids.masked_fill_(torch.arange(width, device=kept.device) >= counts[..., None], -1)


def extend_support(rollout: Rollout, support: torch.Tensor | None, length: int) -> None:
    """Give the ``length`` tokens about to be appended to ``rollout.completion_ids`` their ``support`` (None: tokens
    not sampled through a filter, a tool's output)."""
    rollout.support = concat_supports([(rollout.support, len(rollout.completion_ids)), (support, length)])


def support_rows(rows: Sequence[Sequence[int]], sampling: SamplingSettings) -> torch.Tensor:
    """[len(rows), K] int32: each row's token ids, padded with -1 to the widest; one wider than
    ``sampling.max_support`` is refused."""
    width = check_support_width(max((len(row) for row in rows), default=0), sampling)
    support = torch.full((len(rows), width), -1, dtype=torch.int32)
    for t, row in enumerate(rows):
        support[t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return support


def check_support_width(width: int, sampling: SamplingSettings) -> int:
    """``width``, the most tokens the filters kept at one sampled token, if within ``sampling.max_support``."""
    if width > sampling.max_support:
        raise support_too_wide(sampling, f"kept {width} tokens")
    return width


def support_too_wide(sampling: SamplingSettings, kept: str, fix: str = "raise max_support, or bound the support with top_k") -> RecipeError:
    """The refusal of a sampled token whose filters ``kept`` more tokens than the trainer holds."""
    return RecipeError(
        f"sampling.max_support={sampling.max_support}: a sampled token's filters {kept} (top_p={sampling.top_p}, "
        f"top_k={sampling.top_k}, min_p={sampling.min_p}, temperature={sampling.temperature}); {fix}", "sampling.max_support",
    )


@dataclass
class RolloutBatch:
    """The rollouts of one generation call, grouped: `groups[g]` are the n samples of prompt g."""

    groups: list[list[Rollout]]

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for group in self.groups for r in group]

    @property
    def num_generated_tokens(self) -> int:
        return sum(sum(r.completion_mask or ()) for r in self.rollouts)

    def __len__(self) -> int:
        return len(self.groups)


class GenerationInterrupted(Exception):
    """`generate` ended early by `RolloutEngine.interrupt`: ``partial`` holds every sample as far as it got, those cut
    with finish reason ``interrupted`` (`RolloutEngine.continue_rollouts` finishes them)."""

    def __init__(self, partial: RolloutBatch) -> None:
        super().__init__("generation interrupted")
        self.partial = partial


INTERRUPTED = "interrupted"  # the finish reason of a sample `RolloutEngine.interrupt` cut


def continued(cut: Rollout, more: Rollout) -> Rollout:
    """``cut`` followed by ``more``, the completion an engine sampled from ``cut``'s prompt and completion: one rollout,
    each token keeping the log-prob, version and support it was sampled with. Routes are ``more``'s, which cover the
    whole sequence."""
    if more.prompt_ids != cut.prompt_ids + cut.completion_ids:
        raise ValueError(f"rollout of group {cut.group_id}: the continuation does not start from the cut sequence")
    versions = cut.versions + more.versions
    return Rollout(
        prompt_ids=cut.prompt_ids, completion_ids=cut.completion_ids + more.completion_ids, logprobs=cut.logprobs + more.logprobs,
        weight_version=min(versions, default=more.weight_version), group_id=cut.group_id, finish_reason=more.finish_reason,
        metadata=cut.metadata, routes=more.routes, infra_failure=more.infra_failure,
        support=concat_supports([(cut.support, len(cut.completion_ids)), (more.support, len(more.completion_ids))]),
        token_versions=versions if len(set(versions)) > 1 else None,
    )


def padded_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The rollouts in the padded layout of generate-style trainers (TRL's GRPOTrainer among them): prompts
    left-padded, completions right-padded, each with its mask, and the engine's log-probs per completion token."""
    n = len(rollouts)
    width_p = max(len(r.prompt_ids) for r in rollouts)
    width_c = max(len(r.completion_ids) for r in rollouts)
    batch = {
        "prompt_ids": torch.full((n, width_p), pad_token_id), "prompt_mask": torch.zeros(n, width_p, dtype=torch.long),
        "completion_ids": torch.full((n, width_c), pad_token_id), "completion_mask": torch.zeros(n, width_c, dtype=torch.long),
        "sampling_per_token_logps": torch.zeros(n, width_c),
    }  # fmt: skip
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        batch["prompt_ids"][i, width_p - p :] = torch.tensor(r.prompt_ids)
        batch["prompt_mask"][i, width_p - p :] = 1
        batch["completion_ids"][i, :c] = torch.tensor(r.completion_ids)
        batch["completion_mask"][i, :c] = 1
        batch["sampling_per_token_logps"][i, :c] = torch.tensor(r.logprobs)
    return batch


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images, in the two forms engines take them.

    Args:
        inputs: each image's processor inputs (pixel values, grids), what a transformers model is given.
        images: the images themselves (RGB ``PIL.Image``s), in order, what vLLM's own processor is given.
        template_ids: the prompt as the chat template wrote it, one placeholder per image, before the processor
            expanded the placeholders (vLLM expands them itself; the engine checks it wrote the same prompt).
    """

    inputs: list[dict[str, torch.Tensor]]
    images: list[Any]
    template_ids: list[int]

    def __bool__(self) -> bool:
        return bool(self.inputs)

    def followed_by(self, tokens: Sequence[int]) -> PromptImages:
        """The same images for the prompt continued by ``tokens`` (text: a reply and a tool's response)."""
        return PromptImages(self.inputs, self.images, [*self.template_ids, *tokens])


# What `generate` takes with image prompts: ``images[i]`` for prompt ``i`` (None or empty for a text prompt).
ImagesArg = Sequence[PromptImages | None] | None


class RolloutEngine(abc.ABC):
    """A source of sampled completions whose weights the trainer updates; every engine subclasses it.

    An engine is built as ``Engine(model, seed, **init_args)``: the run gives the model path and its seed, the
    recipe the rest (``model.engine``: a short name, or ``class_path`` + ``init_args``, checked against the
    engine's signature when the recipe is parsed). Implementations must be safe to call `generate` from a
    background thread while the trainer runs (asynchronous mode); `push_weights` may be called between two
    `generate` calls from any thread, and a `generate` already running finishes on the weights it started with.
    """

    # Whether `generate` can record the experts each token is routed to (`Rollout.routes`), and whether it does: the
    # run switches it on when it replays routes (`model.router_replay`).
    can_record_routes: bool = False
    record_routes: bool = False
    # Whether `generate` may be called from several threads at once and serves the calls together (continuous
    # batching): the asynchronous producer then starts the next batch while an earlier one's last completions run.
    concurrent_batches: bool = False

    def __init__(self, seed: int = 0) -> None:
        self._seeds = RequestSeeds(seed)
        self._version = 0
        self._lock = threading.Lock()  # held by generate and push_weights: they exclude each other

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuse, before any model loads, what this engine cannot run on this machine with ``options`` (its init
        arguments, the signature's defaults filled in): a ``ValueError`` whose message starts with the option's name,
        or with the engine's for what no option sets (a package it needs). ``EngineSpec.check_here`` calls it."""

    # The most tokens (prompt and completion) a sequence may hold in this engine, where it sets its own (vLLM's
    # max_model_len); None: the model's context alone bounds it.
    context_length: int | None = None

    @property
    def weight_version(self) -> int:
        """Version of the weights `generate` currently samples with (0 = initial weights)."""
        return self._version

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        """Sample `n` completions for each prompt; `group_id` of each rollout = index of its prompt. ``images[i]``:
        prompt ``i``'s images (`PromptImages`), whose placeholders ``prompts[i]`` holds expanded. Tokens in
        ``sampling.suppress_token_ids`` are never sampled, and leave the distribution whose log-probs are reported."""

    def interrupt(self) -> bool:
        """End the generation in flight now: each `generate` call running raises `GenerationInterrupted` with what its
        samples hold so far, and one that starts before the interrupt is over samples nothing. False where the engine
        cannot (its generation then runs to the end). A stopping run saves the cut samples and finishes them after the
        resume (`continue_rollouts`)."""
        return False

    def continue_rollouts(self, cut: Sequence[Rollout], sampling: SamplingConfig) -> list[Rollout]:
        """Each of ``cut`` (single-turn samples, text prompts) sampled on to the end under ``sampling``, whose
        ``max_new_tokens`` counts the tokens it already holds: a continuation is sampled from the prompt and the cut
        completion with the tokens left, which is the distribution the whole completion would have had (the sampling
        settings have nothing that depends on a token's position besides the length cap, and the repetition penalty
        reads the prompt's tokens as the completion's). Those cut at the cap keep finish reason ``length``."""
        done = [dataclasses.replace(r, finish_reason="length") if len(r.completion_ids) >= sampling.max_new_tokens else None for r in cut]
        by_left: dict[int, list[int]] = {}
        for i, rollout in enumerate(cut):
            if done[i] is None:
                by_left.setdefault(sampling.max_new_tokens - len(rollout.completion_ids), []).append(i)
        for left, which in by_left.items():  # samples cut at the same length share one call (they often all are)
            try:
                more, again = self.generate([cut[i].sequence for i in which], 1, dataclasses.replace(sampling, max_new_tokens=left)), None
            except GenerationInterrupted as interrupted:  # cut once more: each as far as it got now
                more, again = interrupted.partial, interrupted
            for i, group in zip(which, more.groups, strict=True):
                done[i] = continued(cut[i], group[0])
            if again is not None:  # in ``cut``'s order, those not yet continued as they were
                raise GenerationInterrupted(RolloutBatch([[d if d is not None else c for d, c in zip(done, cut)]])) from None
        return [rollout for rollout in done if rollout is not None]

    @abc.abstractmethod
    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the trainer's weights (names as in the HF model's `state_dict`) as `version`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release processes, threads and memory held by the engine."""


# How a recipe gives its engine: ``Engine(model, seed, **init_args)`` (`EngineSpec` reads it).
EngineFactory = Callable[[str, int], RolloutEngine]
# The engines shipped here, by short name (``model.engine: vllm``); their class names work too.
EngineName = Literal["hf", "vllm", "vllm_server"]
SHORT_NAMES: dict[str, str] = {
    "hf": "lightning_rl.rollout.hf.HFRolloutEngine",
    "vllm": "lightning_rl.rollout.vllm_engine.VLLMEngine",
    "vllm_server": "lightning_rl.rollout.vllm_server.VLLMServerEngine",
}


def check_request(prompts: Sequence[Sequence[int]], n: int, images: ImagesArg = None) -> None:
    """What every engine refuses before generating."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts (one per prompt, None for a text prompt)")


def check_expanded(engine: str, group: int, expanded: Sequence[int], prompt: Sequence[int]) -> None:
    """Refuse a prompt the engine expanded otherwise than the processor did: the trainer scores ``prompt``."""
    if list(expanded) != list(prompt):
        at = next((t for t, (a, b) in enumerate(zip(expanded, prompt)) if a != b), min(len(expanded), len(prompt)))
        raise ValueError(
            f"{engine}: prompt {group} expands to {len(expanded)} tokens in vLLM but {len(prompt)} in the model's processor "
            f"(first difference at token {at}): vLLM would sample after another prompt than the one the trainer scores"
        )


def suppressing_bias(sampling: SamplingConfig) -> dict[int, float] | None:
    """vLLM's ``logit_bias`` that keeps ``sampling.suppress_token_ids`` out of the sampled distribution: -inf added
    before temperature and filtering, so the processed log-probs vLLM reports are those of what it sampled from."""
    return {int(t): float("-inf") for t in sampling.suppress_token_ids} or None


class RequestSeeds:
    """An engine's per-call seeds: the request's own seed, else one derived from the engine seed and the call
    count, so a run with the same seed samples the same rollouts."""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def next(self, sampling: SamplingConfig) -> int:
        seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self.calls
        self.calls += 1
        return seed


def _engine_class(path: str) -> type[RolloutEngine]:
    by_class = {full.rpartition(".")[2]: full for full in SHORT_NAMES.values()}  # VLLMEngine, as a recipe may write it
    if path not in SHORT_NAMES and path not in by_class and "." not in path and ":" not in path:
        raise ValueError(f"rollout engine {path!r} is neither one of {', '.join(SHORT_NAMES)} (or {', '.join(by_class)}) nor a dotted path (pkg.module.Class)")
    cls = load_object(SHORT_NAMES.get(path) or by_class.get(path, path), "rollout engine")
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ValueError(f"rollout engine {path!r} is not a RolloutEngine subclass")
    return cls


@dataclass(frozen=True)
class EngineSpec:
    """The engine a run builds: its class and the keyword arguments the recipe gave it."""

    engine_class: type[RolloutEngine]
    init_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any) -> EngineSpec:
        """The spec of what ``model.engine`` holds: a short name or dotted path, an engine class, a
        ``{"class_path", "init_args"}`` mapping (a saved recipe or checkpoint), or a ``functools.partial`` of an
        engine class (what the recipe parser builds from ``class_path`` + ``init_args``). Option names and types
        are checked against the engine's signature; a ``ValueError`` names the option."""
        if isinstance(value, str):
            spec = cls(_engine_class(value))
        elif isinstance(value, type):
            if not issubclass(value, RolloutEngine):
                raise ValueError(f"rollout engine {value.__qualname__} is not a RolloutEngine subclass")
            spec = cls(value)
        elif isinstance(value, Mapping) and "class_path" in value:
            spec = cls(_engine_class(str(value["class_path"])), dict(value.get("init_args") or {}))
        elif isinstance(value, functools.partial):
            found = [a for a in (value.func, *value.args) if isinstance(a, type) and issubclass(a, RolloutEngine)]
            if not found:
                raise ValueError(f"rollout engine {value!r} builds no RolloutEngine subclass")
            spec = cls(found[0], dict(value.keywords))
        else:
            raise ValueError(f"rollout engine {value!r}: give a short name ({', '.join(SHORT_NAMES)}), a class, or class_path + init_args")
        spec.check()
        return spec

    @property
    def class_path(self) -> str:
        return f"{self.engine_class.__module__}.{self.engine_class.__qualname__}"

    def as_config(self) -> dict[str, Any]:
        """Plain data (a checkpoint's hyperparameters load with ``weights_only=True``)."""
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}

    def check(self) -> None:
        """Refuse init arguments the engine does not take (read from its signature) or whose values do not have
        its parameter types (checked by jsonargparse where installed: the recipe parser already checked a recipe's
        own). A ``ValueError`` whose message starts with the option's name."""
        cls = self.engine_class
        parameters = list(inspect.signature(cls).parameters.values())
        given_by_run = {p.name for p in parameters[:2]}  # the model path and the run's seed
        for key in self.init_args:
            if key in given_by_run:
                raise ValueError(f"{key}: set by the run (the model path, the recipe's seed), not an engine option")
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            return  # it takes any keyword: nothing to check it against
        unknown = [key for key in self.init_args if key not in {p.name for p in parameters}]
        if unknown:
            takes = ", ".join(p.name for p in parameters if p.name not in given_by_run)
            raise ValueError(f"{unknown[0]}: not an option of {cls.__name__} (it takes {takes})")
        try:
            from jsonargparse import ArgumentParser  # the recipe parser's; a bare install (e.g. a GPU image) may lack it
        except ImportError:
            return
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, skip=given_by_run)
        try:
            parser.parse_object(dict(self.init_args))
        except Exception as error:  # jsonargparse says a bad value over several lines
            text = " ".join(str(error).split())
            bad = re.search(r'Parser key "([\w.]+)": (.*)', text)
            raise ValueError(f"{bad[1]}: {bad[2][:300]}" if bad else f"{cls.__name__}: {text[:300]}") from None

    def check_here(self) -> None:
        """What ``check`` leaves to the machine that runs the engine (``RolloutEngine.check_options``: a dtype, a
        device, an installed package), refused before any model loads; a launch checks a recipe elsewhere."""
        defaults = {p.name: p.default for p in inspect.signature(self.engine_class).parameters.values() if p.default is not p.empty}
        self.engine_class.check_options({**defaults, **self.init_args})

    def build(self, model_name_or_path: Any, seed: int = 0) -> RolloutEngine:
        return self.engine_class(model_name_or_path, seed, **self.init_args)


# The floating dtypes a transformers model loads in, by their torch names.
TORCH_FLOAT_DTYPES = ("float32", "float", "bfloat16", "float16", "half", "float64", "double")


def check_dtype(dtype: Any, names: Sequence[str]) -> None:
    """``dtype`` one of ``names`` (or, from Python, a ``torch.dtype``)."""
    if not isinstance(dtype, torch.dtype) and dtype not in names:
        raise ValueError(f"dtype: must be one of {', '.join(names)}, got {dtype!r}")


def check_device(device: Any) -> None:
    """``device`` one this machine has: a CUDA device refused where CUDA is not available, or beyond the count."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if found.type in ("cpu", "meta"):
        return
    backend = getattr(torch, found.type, None)
    count = backend.device_count() if backend is not None and hasattr(backend, "device_count") and backend.is_available() else 0
    if count == 0:
        raise ValueError(f"device: {device!r}, but this machine has no {found.type} device ({found.type} is not available to torch)")
    if found.index is not None and found.index >= count:
        raise ValueError(f"device: {device!r}, but this machine has {count} {found.type} device(s)")
