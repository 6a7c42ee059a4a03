"""The rollout-engine interface: what every engine (transformers, vLLM, vLLM server) implements.

An engine turns prompt token ids into sampled completions, reports the log-probability it gave to
each sampled token, and accepts new weights from the trainer. Each rollout records the weight
version that produced it, which is what bounded staleness in asynchronous training is checked on.
"""

from __future__ import annotations

import inspect
import re

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_rl.dotted import load_object


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. `top_k=0`, `top_p=1.0`, `min_p=0.0` and `repetition_penalty=1.0` switch those
    filters off; every engine here supports all four."""

    max_new_tokens: int = 32  # GRPOModule's default too: it reads this one
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    `completion_ids` holds every token after the prompt. In a multi-turn rollout that includes tool
    outputs the model did not sample: `completion_mask` is False for those, and their `logprobs`
    entry is 0.0. `logprobs[t]` is the engine's log p(completion_ids[t]) under the sampling
    distribution's underlying model (temperature-scaled logits, before top-k/top-p filtering).
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


@runtime_checkable
class RolloutEngine(Protocol):
    """A source of sampled completions whose weights the trainer updates.

    Implementations must be safe to call `generate` from a background thread while the trainer
    runs (asynchronous mode); `push_weights` may be called between two `generate` calls from any
    thread, and a `generate` already running finishes on the weights it started with.
    """

    @property
    def weight_version(self) -> int:
        """Version of the weights `generate` currently samples with (0 = initial weights)."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig
    ) -> RolloutBatch:
        """Sample `n` completions for each prompt; `group_id` of each rollout = index of its prompt."""
        ...

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the trainer's weights (names as in the HF model's `state_dict`) as `version`."""
        ...

    def close(self) -> None:
        """Release processes, threads and memory held by the engine."""
        ...


# Engines selectable by short name; any other engine is given as a dotted path to its class.
ENGINE_ALIASES = {
    "hf": "lightning_rl.rollout.hf:HFRolloutEngine",
    "vllm": "lightning_rl.rollout.vllm_engine:VLLMEngine",
    "vllm_server": "lightning_rl.rollout.vllm_server:VLLMServerEngine",
}


def check_request(prompts: Sequence[Sequence[int]], n: int) -> None:
    """What every engine refuses before generating."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class RequestSeeds:
    """An engine's per-call seeds: the request's own seed, else one derived from the engine seed and the call
    count, so a run with the same seed samples the same rollouts."""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def next(self, sampling: SamplingConfig) -> int:
        seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self.calls
        self.calls += 1
        return seed


def engine_class(name: str) -> type:
    """The engine class an alias (``hf``, ``vllm``, ``vllm_server``) or ``pkg.module:Class`` names (nothing of vLLM
    is imported yet: the engines import it when built)."""
    if name not in ENGINE_ALIASES and ":" not in name and "." not in name:
        raise ValueError(f"rollout engine {name!r} is neither one of {', '.join(ENGINE_ALIASES)} nor a dotted path (pkg.module:Class)")
    return load_object(ENGINE_ALIASES.get(name, name), "rollout engine")


def check_engine_options(name: str, options: dict[str, Any]) -> None:
    """Refuse, before any model loads, engine options the engine's constructor does not take (read from its
    signature) or whose values do not have its parameter types (checked by jsonargparse, where installed). A
    ``ValueError`` whose message starts with the option's name; the model path and ``seed`` come from the run."""
    cls = engine_class(name)
    signature = inspect.signature(cls)
    parameters = list(signature.parameters)
    given_by_run = {parameters[0], "seed"} if parameters else {"seed"}
    for key in options:
        if key in given_by_run:
            raise ValueError(f"{key}: set by the run (the model path, the recipe's seed), not an engine option")
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return  # it takes any keyword: nothing to check it against
    unknown = [key for key in options if key not in parameters]
    if unknown:
        takes = ", ".join(p for p in parameters if p not in given_by_run)
        raise ValueError(f"{unknown[0]}: not an option of {cls.__name__} (it takes {takes})")
    try:
        from jsonargparse import ArgumentParser  # the recipe parser's; a bare install (e.g. a GPU image) may lack it
    except ImportError:
        return
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, skip=given_by_run)
    try:
        parser.parse_object(dict(options))
    except Exception as error:  # jsonargparse says a bad value over several lines
        text = " ".join(str(error).split())
        bad = re.search(r'Parser key "([\w.]+)": (.*)', text)
        raise ValueError(f"{bad[1]}: {bad[2][:300]}" if bad else f"{cls.__name__}: {text[:300]}") from None


def load_engine(name: str, model_name_or_path: str, **options: Any) -> RolloutEngine:
    """Build an engine by alias or `pkg.module:Class`; the class is called as
    `Class(model_name_or_path, **options)`."""
    engine = engine_class(name)(model_name_or_path, **options)
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout engine {name!r} does not implement RolloutEngine")
    return engine
