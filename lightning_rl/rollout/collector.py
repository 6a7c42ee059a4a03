"""The rollout side of GRPO: a prompt batch index in, a `ScoredBatch` out.

`RolloutCollector.collect(i)` renders step `i`'s prompts, samples `num_generations` completions of each (or converses
with the tools, up to `max_turns`), scores them with the reward functions and, with dynamic sampling, replaces the
groups whose rewards all tie. It is what the asynchronous producer thread runs, so it is given everything it uses
(engine, prompts, renderer, scorer, sampling settings) and never touches the LightningModule or the Trainer.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from lightning_rl import validation
from lightning_rl.data.rendering import PromptRenderer, PromptSource, RenderedPrompt
from lightning_rl.errors import DataError, RecipeError, UserError
from lightning_rl.rewards import NO_REWARD_COLUMNS, RewardScorer, TrainerState
from lightning_rl.rollout.base import INTERRUPTED, GenerationInterrupted, PromptImages, Rollout, RolloutBatch, RolloutEngine, SamplingConfig
from lightning_rl.rollout.buffer import BatchInterrupted, ScoredBatch
from lightning_rl.rollout.conversation import ToolConversation, check_tool_call_format, completion_text, distinct_tool_calls, visible_text
from lightning_rl.stopping import StepAbandoned
from lightning_rl.tools import Tool, ToolExecutor, as_tool, tool_reference

log = logging.getLogger(__name__)

# How many times in a row a step is sampled again when every rollout of it failed for infrastructure reasons, before
# the run stops: a passing fault (an engine restarting) costs a resample, a lasting one ends the run in one line.
ALL_EXCLUDED_ATTEMPTS = 3



@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How a prompt batch becomes rollouts: the GRPO recipe keys of the same names (see `GRPOModule`).

    The tools are loaded (and their schemas checked) as the settings are made, so a tool that does not import is
    refused with the recipe.
    """

    num_generations: int = 8
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4
    tools: tuple[Any, ...] = ()  # dotted paths, functions or Tools
    max_turns: int = 1
    samples_per_turn: tuple[int, ...] = ()
    tool_timeout_s: float = 10.0
    tool_output_max_chars: int = 4000
    max_context_tokens: int | None = None
    seed: int = 0
    loaded_tools: tuple[Tool, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise RecipeError(
                f"num_generations={self.num_generations}: GRPO needs G >= 2 samples per prompt (advantages compare them)",
                "num_generations",
            )
        counts = {"max_turns": self.max_turns, "dynamic_sampling_max_rounds": self.dynamic_sampling_max_rounds,
                  "tool_output_max_chars": self.tool_output_max_chars,
                  **{f"samples_per_turn[{i}]": n for i, n in enumerate(self.samples_per_turn)}}  # fmt: skip
        for key, value in counts.items():
            validation.positive_int(key, value)
        if self.max_context_tokens is not None:
            validation.positive_int("max_context_tokens", self.max_context_tokens)
        validation.finite_positive("tool_timeout_s", self.tool_timeout_s)
        if self.max_turns > 1 and not self.tools:
            raise RecipeError("max_turns > 1 needs at least one tool", "max_turns")
        if self.tools and self.max_turns == 1:
            print("note: tools with max_turns=1: the model is shown the tools and its one reply is scored, but no call it "
                  "makes is run (max_turns counts replies: TRL's max_tool_calling_iterations + 1)", file=sys.stderr)
        if len(self.samples_per_turn) > self.max_turns - 1:  # entry i forks turn i + 2's replies
            raise RecipeError(
                f"samples_per_turn has {len(self.samples_per_turn)} entries, but max_turns={self.max_turns} leaves "
                f"{self.max_turns - 1} turn(s) after the first to fork; drop the extra entries or raise max_turns",
                "samples_per_turn",
            )
        tools = tuple(_loaded(tool, f"tools[{i}]") for i, tool in enumerate(self.tools))
        validation.unique("tools", [tool.name for tool in tools])
        object.__setattr__(self, "loaded_tools", tools)

    @property
    def tool_references(self) -> list[str]:
        """The tools as plain data (dotted paths), for a checkpoint's hyperparameters."""
        return [tool_reference(tool) for tool in self.tools]

    @property
    def tool_specs(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template shows them to the model (None without tools)."""
        return [tool.chat_template_spec() for tool in self.loaded_tools] or None


class RolloutCollector:
    """Collects the scored rollouts of prompt batches.

    Args:
        engine: samples the completions.
        prompts: the prompt records of each step (`PromptSource`).
        renderer: renders a record into the tokens the engine samples from.
        scorer: the reward functions.
        sampling: the run's sampling settings; each request gets a seed of its own (`sampling_for`).
        settings: generations per prompt, tools and turns, dynamic sampling, the seed.
        model_context: the model's context in tokens (`model_context`); ``max_context_tokens`` may only narrow it.
        max_steps, steps_per_batch: the run's optimizer steps and those taken on each batch (``num_iterations``),
            for the reward functions' ``trainer_state`` and the step its lines name (`step_of`).
        rank: the trainer's rank, which each request's seed holds: ranks sample independently of each other.
    """

    def __init__(
        self, engine: RolloutEngine, prompts: PromptSource, renderer: PromptRenderer, scorer: RewardScorer,
        sampling: SamplingConfig, settings: RolloutSettings, model_context: int | None = None,
        max_steps: int = -1, steps_per_batch: int = 1, rank: int = 0,
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.prompts = prompts
        self._column_keys: list[str] | None = None
        self.renderer = renderer
        self.scorer = scorer
        self.sampling = sampling
        self.settings = settings
        # The tightest of the contexts a sequence must fit (the engine's own, vLLM's max_model_len, too), and its name.
        limits = {"max_context_tokens": settings.max_context_tokens, "the model's max_position_embeddings": model_context,
                  "the engine's max_model_len": getattr(engine, "context_length", None)}  # fmt: skip
        known = [(limit, said) for said, limit in limits.items() if limit is not None]
        self.context_limit, self.context_said = min(known) if known else (None, None)
        self.max_steps, self.steps_per_batch = max_steps, steps_per_batch
        self.executor: ToolExecutor | None = None
        if settings.loaded_tools:
            check_tool_call_format(renderer.tokenizer, renderer.model_name)
            self.executor = ToolExecutor(
                list(settings.loaded_tools), timeout_s=settings.tool_timeout_s, max_output_chars=settings.tool_output_max_chars
            )
        self._check_every_prompt()

    def _check_every_prompt(self) -> None:
        """Every text prompt of the data rendered and fitted to the context once, before the first step: a row its
        template refuses, or one too long, is refused naming it now, not when a batch first draws it (hours in, or
        never in a short run). Prompts with images are rendered at their step (their files were checked on reading)."""
        records = [r for r in self.prompts.records if not any(isinstance(m.get("content"), list) for m in self.renderer.messages(r))]
        self._check_prompts_fit(records, [self.renderer.render(record, self.prompts) for record in records])

    def close(self) -> None:
        """Stop the tool workers."""
        if self.executor is not None:
            self.executor.close()

    def step_of(self, index: int) -> int:
        """The optimizer step (from 1) that first trains batch ``index``: what its lines and errors name."""
        return index * self.steps_per_batch + 1

    def collect(self, index: int, partial: list[Rollout] | None = None) -> ScoredBatch:
        """Rollouts of prompt batch `index` with their rewards; ``partial``: its samples as a stopped run left them
        (`BatchInterrupted`), the cut ones to sample on to the end.

        Rollouts that failed for infrastructure reasons are left out, with their groups when fewer than two samples
        remain (`without_infra_failures`). A batch left with nothing is sampled again, with seeds of its own, up to
        `ALL_EXCLUDED_ATTEMPTS` times in all; then the run stops, naming the failures.

        With ``dynamic_sampling`` the groups whose rewards all tie (no signal) are dropped and more prompts are
        sampled, up to ``dynamic_sampling_max_rounds`` rounds, until the batch has as many groups as prompts."""
        excluded, failures = Counter[str](), Counter[str]()  # over every attempt
        excluded_groups = 0
        for attempt in range(ALL_EXCLUDED_ATTEMPTS):
            scored = self._collect(index, first_round=attempt * self.settings.dynamic_sampling_max_rounds, partial=partial if attempt == 0 else None)
            excluded.update(scored.excluded_rollouts)
            failures.update(scored.reward_failure_kinds)
            excluded_groups += scored.excluded_groups
            if scored.rollouts:
                return dataclasses.replace(scored, excluded_rollouts=dict(excluded), excluded_groups=excluded_groups, reward_failure_kinds=dict(failures))
            if attempt + 1 < ALL_EXCLUDED_ATTEMPTS:
                log.warning(
                    "step %d: every rollout failed for infrastructure reasons (%s); sampling the step again (attempt %d "
                    "of %d)", self.step_of(index), _reasons(excluded), attempt + 2, ALL_EXCLUDED_ATTEMPTS,
                )
        raise InfraFailureError(
            f"step {self.step_of(index)}: every rollout failed for infrastructure reasons in {ALL_EXCLUDED_ATTEMPTS} attempts in a "
            f"row ({_reasons(excluded)}): see the engine's log, the tools' workers, reward_timeout_s"
        )

    def _collect(self, index: int, first_round: int, partial: list[Rollout] | None = None) -> ScoredBatch:
        """One attempt at batch `index`, its rounds of dynamic sampling numbered from `first_round` (their seeds)."""
        records = self.prompts.prompt_batch(index)
        scored = self.sample_and_score(index, first_round, records, partial)
        if not self.settings.dynamic_sampling:
            return scored
        wanted = sampled = len(records)
        kept = groups_with_signal(scored)
        rounds, limit = 1, "dynamic_sampling_max_rounds"
        while len(kept.records) < wanted and rounds < self.settings.dynamic_sampling_max_rounds:
            extra_records = self.prompts.extra_prompts(index, sampled - wanted, wanted - len(kept.records))
            if not extra_records:  # a source with no other prompts left to draw
                limit = "the prompt source has no more prompts"
                break
            extra = self.sample_and_score(index, first_round + rounds, extra_records)
            sampled += len(extra_records)
            kept = merged(kept, groups_with_signal(extra))
            rounds += 1
        if len(kept.records) < wanted:
            log.warning(
                "step %d: dynamic sampling found %d of %d groups with differing rewards after %d rounds "
                "(%s); %s", self.step_of(index), len(kept.records), wanted, rounds, limit,
                "training on those" if kept.records else "the step trains the first round's groups, whose advantages are all 0",
            )
        filtered = sampled - len(kept.records) - kept.excluded_groups  # the rest left for infrastructure failures
        if not kept.records:  # nothing carries signal: the first round's samples, whose advantages are all 0, with every round's counts
            kept = dataclasses.replace(kept, records=scored.records, rollouts=scored.rollouts, rewards=scored.rewards, reward_terms=scored.reward_terms,
                                       reward_errors=scored.reward_errors, logged_columns=scored.logged_columns)
        kept.sampling_rounds, kept.sampled_groups, kept.filtered_groups = rounds, sampled, filtered
        return kept

    def sample_and_score(self, index: int, round: int, records: list[dict[str, Any]], partial: list[Rollout] | None = None) -> ScoredBatch:
        """One round of step `index`: the records' rollouts, scored. ``partial``: see `collect`."""
        rendered = [self.renderer.render(record, self.prompts) for record in records]
        self._check_prompts_fit(records, rendered)
        prompts = [r.ids for r in rendered]
        engine_images = [_engine_images(r) for r in rendered] if any(r.pictures for r in rendered) else None
        if partial is not None and sorted({(r.group_id, tuple(r.prompt_ids)) for r in partial}) != list(enumerate(map(tuple, prompts))):
            log.warning("step %d: the saved partial completions were sampled from other prompts than this run renders (its "
                        "data or chat template changed): sampling the step anew", self.step_of(index))
            partial = None
        # A stopping run keeps what it sampled, to finish (and score) after the resume, where it can take it up again:
        # single-turn text prompts, in the step's first round (a later round's would need the earlier rounds' too).
        resumable = round == 0 and self.executor is None and engine_images is None
        started = time.perf_counter()
        try:
            batch = self._generate(index, round, records, prompts, engine_images, partial)
        except GenerationInterrupted as cut:
            if resumable:
                raise BatchInterrupted(index, cut.partial.rollouts) from None
            raise StepAbandoned(f"rollout batch {index} had not returned") from None
        generation_seconds = time.perf_counter() - started
        rollouts = batch.rollouts
        if engine_images is not None:
            for rollout in rollouts:  # each rollout trains with its prompt's images
                rollout.metadata["images"] = rendered[rollout.group_id].keyed_images
        conversational = any(isinstance(record["prompt"], list) for record in records)
        try:
            scores = self.scorer.score(
                [self.renderer.tokenizer.decode(r.prompt_ids) for r in rollouts], [self.reply_text(r) for r in rollouts],  # as read
                self._columns(records, rendered, rollouts), step=self.step_of(index),
                chat_prompts=[copy.deepcopy(rendered[r.group_id].for_rewards) for r in rollouts] if conversational else None,
                chat_completions=[self.reply_messages(r) for r in rollouts] if conversational else None,
                trainer_state=TrainerState(self.step_of(index) - 1, self.max_steps, self.prompts.epoch_of(index), self.rank == 0,
                                           int(os.environ.get("LOCAL_RANK", self.rank)) == 0),
            )
        except StepAbandoned as stopped:  # stopped while its rewards were computed: the samples are whole, scored after the resume
            if resumable:
                raise BatchInterrupted(index, rollouts, stopped.why) from None
            raise
        calls = distinct_tool_calls(rollouts)
        failures = Counter(call["failure"] for call in calls if call["failure"] is not None)
        mark_infra_failures(rollouts, scores.errors)
        return without_infra_failures(ScoredBatch(
            index=index,
            records=records,
            rollouts=rollouts,
            rewards=scores.total.tolist(),
            reward_terms={name: values.tolist() for name, values in scores.per_function.items()},
            reward_errors=[vars(e) for e in scores.errors],
            logged_columns=scores.logged_columns,
            logged_metrics=scores.logged_metrics,
            generation_seconds=generation_seconds,
            tool_calls=len(calls),
            tool_failures=dict(failures),
            sampled_rollouts=len(rollouts),
            reward_failures=scores.failed_samples(),
            reward_failure_kinds={f"{name}/{kind}": count for name, kinds in scores.failure_counts().items() for kind, count in kinds.items()},
            first_reward_failures=scores.first_failures(),
        ))

    def _generate(self, index: int, round: int, records: list[dict[str, Any]], prompts: list[list[int]],
                  engine_images: list[PromptImages | None] | None, partial: list[Rollout] | None) -> RolloutBatch:
        if self.executor is not None:
            settings = self.settings
            conversation = ToolConversation(self.engine, self.renderer.tokenizer, self.executor, settings.max_turns, self.context_limit)
            samples = [settings.num_generations, *settings.samples_per_turn]
            return conversation.generate(prompts, samples, lambda turn: self.sampling_for(index, turn, round), images=engine_images,
                                         template_kwargs=[record.get("chat_template_kwargs") or {} for record in records])
        if partial is None:
            return self.engine.generate(prompts, self.settings.num_generations, self.sampling_for(index, 0, round), images=engine_images)
        # Turn -1: seeds of their own, so no continuation shares its random stream with a sample of the first call.
        cut = [i for i, r in enumerate(partial) if r.finish_reason == INTERRUPTED]

        def grouped(finished: list[Rollout]) -> RolloutBatch:  # ``partial`` with its cut samples replaced
            whole = list(partial)
            for i, rollout in zip(cut, finished, strict=True):
                whole[i] = rollout
            return RolloutBatch([[r for r in whole if r.group_id == g] for g in range(len(prompts))])

        try:
            return grouped(self.engine.continue_rollouts([partial[i] for i in cut], self.sampling_for(index, -1, round)))
        except GenerationInterrupted as again:  # stopped again: each cut sample as far as it got now
            raise GenerationInterrupted(grouped(again.partial.rollouts)) from None

    def sampling_for(self, index: int, turn: int, round: int = 0) -> SamplingConfig:
        """The sampling of batch `index`'s turn and dynamic-sampling round on this rank: a seed of its own makes
        sampling independent of where and when it runs. A hash of them all: an engine seeds a call's samples from it
        upwards (vLLM: seed + k per sample), and seeds a few apart let a call of more samples than that draw what the
        next turn or batch drew; without the rank, two ranks drew the same completions of a prompt."""
        key = f"{self.settings.seed}/{index}/{turn}/{round}/{self.rank}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2  # room below 2**63 for + k
        return dataclasses.replace(self.sampling, seed=seed)


    def reply_text(self, rollout: Rollout) -> str:
        """What rewards read as the completion: the model's last reply."""
        return rollout.metadata.get("final_reply", completion_text(self.renderer.tokenizer, rollout.completion_ids))

    def reply_messages(self, rollout: Rollout) -> list[dict[str, Any]]:
        """What rewards read as the completion of a conversational prompt (TRL's shape): the messages the model's
        turns added, each assistant turn followed by its tool results."""
        if rollout.messages:  # a conversation with tools
            return [dict(message) for message in rollout.messages]
        return [{"role": "assistant", "content": self.reply_text(rollout)}]

    def _columns(self, records: list[dict[str, Any]], rendered: list[RenderedPrompt], rollouts: list[Rollout]) -> dict[str, list[Any]]:
        """What the reward functions get per rollout besides prompts and completions: its record's columns (every
        column any record holds, None where its record has none, as a dataset's column is) and `rewards.ROLLOUT_COLUMNS`.
        Each rollout gets its own copy: a reward that changes what it is given changes neither the other rollouts'
        nor the data's (the next pass's prompts)."""
        if self._column_keys is None:  # the data's columns do not change: read once (every record is looked at)
            self._column_keys = sorted(self.prompts.columns() - NO_REWARD_COLUMNS)
        keys = self._column_keys
        columns = {key: [copy.deepcopy(records[r.group_id].get(key)) for r in rollouts] for key in keys}
        columns["tool_calls"] = [r.metadata.get("tool_calls", []) for r in rollouts]
        columns["transcripts"] = [visible_text(self.renderer.tokenizer, r.completion_ids) for r in rollouts]
        columns["completion_ids"] = [list(r.completion_ids) for r in rollouts]
        columns["prompt_messages"] = [copy.deepcopy(rendered[r.group_id].messages) for r in rollouts]
        return columns

    def _check_prompts_fit(self, records: list[dict[str, Any]], rendered: list[RenderedPrompt]) -> None:
        """A prompt that leaves no room for ``max_new_tokens`` in the context is refused, naming its row: past the
        model's positions an engine either fails or samples from positions the model never learned."""
        limit, budget = self.context_limit, self.sampling.max_new_tokens
        if limit is None:
            return
        for record, prompt in zip(records, rendered, strict=True):
            if len(prompt.ids) + budget > limit:
                raise DataError(
                    f"{self.prompts.location(record)}: the prompt is {len(prompt.ids)} tokens; with sampling.max_new_tokens={budget} "
                    f"it does not fit the context of {limit} tokens ({self.context_said}): shorten it or lower sampling.max_new_tokens"
                )


def _engine_images(prompt: RenderedPrompt) -> PromptImages | None:
    return PromptImages(prompt.image_inputs, prompt.pictures, prompt.template_ids) if prompt.pictures else None


class InfraFailureError(UserError, RuntimeError):
    """Every rollout of a step failed for infrastructure reasons, attempt after attempt: the run stops (exit 1), as
    training on nothing would not be a step."""

    exit_code = 1


def _reasons(counts: Counter[str]) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()))


def mark_infra_failures(rollouts: list[Rollout], reward_errors: list[Any]) -> None:
    """Set `Rollout.infra_failure` where a tool's worker died under one of its calls or a reward call timed out on
    it (an engine marks its own). A tool's or a reward's own error is the rollout's doing: it stays."""
    for rollout in rollouts:
        if rollout.infra_failure is None and any(c["failure"] == "worker_lost" for c in rollout.metadata.get("tool_calls", ())):
            rollout.infra_failure = "tool_worker"
    for error in reward_errors:
        if error.kind == "timeout" and rollouts[error.sample].infra_failure is None:
            rollouts[error.sample].infra_failure = "reward_timeout"


def without_infra_failures(scored: ScoredBatch) -> ScoredBatch:
    """The batch without its rollouts that failed for infrastructure reasons, and without the groups left with fewer
    than two valid samples (nothing to compare), renumbered; both counted (`excluded_rollouts` by reason,
    `excluded_groups`). The advantages, the loss and its normalisers then see the valid samples only: a failed
    sample is not scored 0."""
    failed = Counter(r.infra_failure for r in scored.rollouts if r.infra_failure is not None)
    if not failed:
        return scored
    valid = Counter(r.group_id for r in scored.rollouts if r.infra_failure is None)
    keep = [g for g in range(len(scored.records)) if valid[g] >= 2]
    subset = _subset(scored, keep, lambda rollout: rollout.infra_failure is None)
    subset.excluded_rollouts = dict(Counter(scored.excluded_rollouts) + failed)
    subset.excluded_groups = scored.excluded_groups + len(scored.records) - len(keep)
    return subset


def groups_with_signal(scored: ScoredBatch) -> ScoredBatch:
    """The batch without the groups whose rewards all tie (their advantages are 0: no gradient), renumbered. A sample
    without a reward (no reward function applied) is no signal."""
    by_group: dict[int, list[float]] = {}
    for reward, rollout in zip(scored.rewards, scored.rollouts, strict=True):
        by_group.setdefault(rollout.group_id, []).extend([] if math.isnan(reward) else [reward])
    keep = [g for g, rewards in sorted(by_group.items()) if rewards and max(rewards) - min(rewards) > 1e-6]
    return _subset(scored, keep)


def _subset(scored: ScoredBatch, keep: list[int], wanted: Callable[[Rollout], bool] = lambda rollout: True) -> ScoredBatch:
    """The batch with the groups `keep` only (renumbered in that order) and, of their rollouts, those `wanted`."""
    new_id = {g: k for k, g in enumerate(keep)}
    picked = [i for i, r in enumerate(scored.rollouts) if r.group_id in new_id and wanted(r)]
    position = {i: k for k, i in enumerate(picked)}
    return dataclasses.replace(
        scored,
        records=[scored.records[g] for g in keep],
        rollouts=[dataclasses.replace(scored.rollouts[i], group_id=new_id[scored.rollouts[i].group_id]) for i in picked],
        rewards=[scored.rewards[i] for i in picked],
        reward_terms={name: [values[i] for i in picked] for name, values in scored.reward_terms.items()},
        reward_errors=[{**e, "sample": position[e["sample"]]} for e in scored.reward_errors if e["sample"] in position],
        logged_columns={name: [values[i] for i in picked] for name, values in scored.logged_columns.items()},
    )


def merged(first: ScoredBatch, second: ScoredBatch) -> ScoredBatch:
    """Two batches of the same step as one, the second's groups numbered after the first's."""
    offset = len(first.records)
    failures = Counter(first.tool_failures) + Counter(second.tool_failures)
    return dataclasses.replace(
        first,
        records=first.records + second.records,
        rollouts=first.rollouts + [dataclasses.replace(r, group_id=r.group_id + offset) for r in second.rollouts],
        rewards=first.rewards + second.rewards,
        reward_terms={name: first.reward_terms[name] + second.reward_terms[name] for name in first.reward_terms},
        reward_errors=first.reward_errors + [{**e, "sample": e["sample"] + len(first.rollouts)} for e in second.reward_errors],
        generation_seconds=first.generation_seconds + second.generation_seconds,
        tool_calls=first.tool_calls + second.tool_calls,
        tool_failures=dict(failures),
        sampled_rollouts=first.sampled_rollouts + second.sampled_rollouts,
        reward_failures=dict(Counter(first.reward_failures) + Counter(second.reward_failures)),
        reward_failure_kinds=dict(Counter(first.reward_failure_kinds) + Counter(second.reward_failure_kinds)),
        first_reward_failures={**second.first_reward_failures, **first.first_reward_failures},
        excluded_rollouts=dict(Counter(first.excluded_rollouts) + Counter(second.excluded_rollouts)),
        excluded_groups=first.excluded_groups + second.excluded_groups,
        logged_columns={name: first.logged_columns.get(name, [None] * len(first.rollouts))
                        + second.logged_columns.get(name, [None] * len(second.rollouts))
                        for name in {**first.logged_columns, **second.logged_columns}},
        logged_metrics={name: first.logged_metrics.get(name, []) + second.logged_metrics.get(name, [])
                        for name in {**first.logged_metrics, **second.logged_metrics}},
    )


def _loaded(tool: Any, key: str) -> Tool:
    """A recipe's tool, built; one that cannot be (not importable, no schema, not sendable) refused naming its key."""
    try:
        return as_tool(tool)
    except UserError:
        raise
    except ValueError as error:
        raise RecipeError(str(error), key) from None
