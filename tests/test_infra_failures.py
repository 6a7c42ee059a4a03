"""Rollouts that failed for infrastructure reasons (a tool's worker died, a reward timed out) are left out of their
group's advantages and of the loss, not scored 0; a group left with fewer than two valid samples leaves the step;
both are counted. The collector with a scripted engine, then a real GRPO run whose reward times out on some samples."""

from __future__ import annotations

import csv
import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from support.grpo import FAST
from lightning_rl.data.prompts import PromptDataModule, PromptRenderer
from lightning_rl.losses import group_advantages
from lightning_rl.losses.advantages import STD_EPSILON
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.modules.grpo_metrics import batch_metrics
from lightning_rl.rewards import RewardScorer, RewardSpec
from lightning_rl.rollout.base import ImagesArg, Rollout, RolloutBatch, RolloutEngine, SamplingConfig
from lightning_rl.rollout.collector import ALL_EXCLUDED_ATTEMPTS, InfraFailureError, RolloutCollector, RolloutSettings
from lightning_rl.rollout.conversation import visible_text

TOOLS = ("lightning_rl.tools.builtin:calculator", "support.tool_faults:dies")


class ScriptedEngine(RolloutEngine):
    """Sample k of a prompt replies ``script(prompt_text)[k]`` (the last one repeated), ended by the end token."""

    def __init__(self, tokenizer: Any, script: Any) -> None:
        super().__init__(seed=0)
        self.tokenizer, self.script = tokenizer, script
        self.seeds: list[int | None] = []

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        self.seeds.append(sampling.seed)
        groups = []
        for g, prompt in enumerate(prompts):
            replies = self.script(self.tokenizer.decode(prompt))
            ids = [self.tokenizer.encode(replies[min(k, len(replies) - 1)], add_special_tokens=False) + [self.tokenizer.eos_token_id]
                   for k in range(n)]  # fmt: skip
            # "ABORT": the engine died under the request, as the server engine reports it.
            groups.append([Rollout(list(prompt), t, [-0.5] * len(t), 0, g, finish_reason="stop") if "ABORT" not in replies[min(k, len(replies) - 1)]
                           else Rollout(list(prompt), t, [-0.5] * len(t), 0, g, finish_reason="abort", infra_failure="engine")
                           for k, t in enumerate(ids)])  # fmt: skip
        return RolloutBatch(groups)

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        self._version = version

    def close(self) -> None:
        pass


class Prompts:
    path = "prompts.jsonl"
    image_folder = None

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def prompt_batch(self, index: int) -> list[dict[str, Any]]:
        return self.records

    def location(self, record: dict[str, Any]) -> str:
        return f"prompts.jsonl: line {self.records.index(record) + 1}"

    def columns(self) -> set[str]:
        return {"prompt"}

    def epoch_of(self, index: int) -> int:
        return 0


def last_digit(completions: list[str], **_: Any) -> list[float]:
    return [float(c.strip()[-1]) for c in completions]


SLOW: set[str] = set()  # completions the reward below does not answer in time


def slow_digit(completions: list[str], **_: Any) -> list[float]:
    """The last digit, one completion at a time; past the time limit for those in `SLOW`."""
    if len(completions) > 1:
        raise RuntimeError("one completion at a time")
    if completions[0] in SLOW:
        time.sleep(10.0)
    return last_digit(completions)


def collector(tokenizer: Any, script: Any, records: list[dict[str, Any]], reward: str, **settings: Any) -> RolloutCollector:
    settings = RolloutSettings(**{"num_generations": 3, **settings})
    # 1 s: ample for the fast calls on a loaded machine, and a tenth of the slow ones' sleep
    scorer = RewardScorer([RewardSpec(f"test_infra_failures:{reward}")], all_failed="zero", timeout_s=1.0)
    renderer = PromptRenderer(tokenizer, tools=settings.tool_specs)
    return RolloutCollector(ScriptedEngine(tokenizer, script), Prompts(records), renderer, scorer,
                            SamplingConfig(max_new_tokens=64), settings)  # fmt: skip


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def crashing_tools(prompt: str) -> list[str]:
    if "<tool_response>" in prompt:
        return ["done 7"]
    if "first" in prompt:  # a killed worker, a plain answer, a tool that raises (the rollout's own failure)
        return [call("dies", {}), "answer 1", call("calculator", {"operation": "divide", "a": 1, "b": 0})]
    return [call("dies", {}), call("dies", {}), "answer 3"]  # one valid sample left: the group leaves


def test_a_dead_tool_worker_excludes_its_rollout_and_a_group_left_with_one_sample(tiny_tokenizer):
    rollouts = collector(tiny_tokenizer, crashing_tools, [{"prompt": "first"}, {"prompt": "second"}], "last_digit",
                         tools=TOOLS, max_turns=2)  # fmt: skip
    try:
        scored = rollouts.collect(0)
    finally:
        rollouts.close()
    assert scored.tool_failures == {"worker_lost": 3, "raised": 1}
    # Calls and failures are counted over the same rollouts, every one sampled (the left-out ones made the failures).
    figures = batch_metrics(scored, with_tools=True)
    assert (figures["tools/calls"], figures["tools/failures/worker_lost"], figures["tools/failures/raised"]) == (4, 3, 1)
    assert (figures["tools/call_frequency"], figures["tools/failure_frequency"]) == (4 / 6, 1.0)  # TRL's two figures
    assert float(figures["tools/context_ended_fraction"]) == 0.0
    scored.rollouts[0].metadata["ended"] = "context_length"  # its calls' results did not fit: counted, not silent
    assert float(batch_metrics(scored, with_tools=True)["tools/context_ended_fraction"]) == 0.5
    assert scored.records == [{"prompt": "first"}] and [r.group_id for r in scored.rollouts] == [0, 0]
    assert scored.rewards == [1.0, 7.0]  # "answer 1", and "done 7" after the calculator's ZeroDivisionError
    assert "ZeroDivisionError" in scored.rollouts[1].metadata["tool_calls"][0]["content"]
    assert scored.excluded_rollouts == {"tool_worker": 3} and scored.excluded_groups == 1
    assert all(r.infra_failure is None for r in scored.rollouts)
    # The advantages are those of the two valid samples alone: +-(7 - 1) / 2 over their std, sqrt(18).
    advantages = group_advantages(torch.tensor(scored.rewards), torch.tensor([0, 0]))
    assert advantages.tolist() == pytest.approx([-3 / (18**0.5 + STD_EPSILON), 3 / (18**0.5 + STD_EPSILON)], abs=1e-6)
    # Scored 0 instead, the dead worker's sample would have pulled the mean and the std: the control differs.
    assert group_advantages(torch.tensor([0.0, 1.0, 7.0]), torch.tensor([0, 0, 0]))[1:].tolist() != pytest.approx(advantages.tolist())


def three_answers(prompt: str) -> list[str]:
    return ["answer 1", "answer 2", "answer 4"]


def aborted_in_a_later_turn(prompt: str) -> list[str]:
    if "<tool_response>" in prompt:  # the engine dies under the reply to the third sample's call only
        return ["ABORT 6" if re.search(r"<tool_response>\s*6\s*</tool_response>", prompt) else "done 7"]
    return [call("calculator", {"operation": "add", "a": k, "b": k}) for k in (1, 2, 3)]


def test_an_engine_that_died_in_a_later_turn_of_a_conversation_excludes_that_rollout(tiny_tokenizer):
    rollouts = collector(tiny_tokenizer, aborted_in_a_later_turn, [{"prompt": "add"}], "last_digit", tools=TOOLS, max_turns=2)
    try:
        scored = rollouts.collect(0)
    finally:
        rollouts.close()
    assert scored.excluded_rollouts == {"engine": 1} and scored.rewards == [7.0, 7.0]
    assert [r.metadata["tool_calls"][0]["content"] for r in scored.rollouts] == ["2", "4"]


def test_a_timed_out_reward_excludes_its_sample_and_a_step_with_nothing_left_is_sampled_again_then_stops(tiny_tokenizer):
    SLOW.clear()
    SLOW.add("answer 2")
    scored = collector(tiny_tokenizer, three_answers, [{"prompt": "q"}], "slow_digit").collect(0)
    assert scored.rewards == [1.0, 4.0] and scored.excluded_rollouts == {"reward_timeout": 1} and scored.excluded_groups == 0
    assert scored.reward_errors == []  # the timed-out sample left the batch with its error
    # Every sample times out: the step is sampled again with new seeds, and after the last attempt the run stops.
    SLOW.update({"answer 1", "answer 4"})
    stuck = collector(tiny_tokenizer, three_answers, [{"prompt": "q"}], "slow_digit")
    with pytest.raises(InfraFailureError) as caught:
        stuck.collect(4)
    assert str(caught.value) == (
        f"step 5: every rollout failed for infrastructure reasons in {ALL_EXCLUDED_ATTEMPTS} attempts in a row "
        "(reward_timeout: 9): see the engine's log, the tools' workers, reward_timeout_s"
    )
    assert caught.value.exit_code == 1 and len(stuck.engine.seeds) == ALL_EXCLUDED_ATTEMPTS == len(set(stuck.engine.seeds))
    # A passing fault: the first attempt loses everything, the second trains, and the count keeps both.
    passing = collector(tiny_tokenizer, three_answers, [{"prompt": "q"}], "slow_digit")
    original = passing.sample_and_score

    def then_recover(*args: Any) -> Any:
        scored = original(*args)
        SLOW.clear()
        return scored

    passing.sample_and_score = then_recover
    scored = passing.collect(4)
    assert scored.rewards == [1.0, 2.0, 4.0] and scored.excluded_rollouts == {"reward_timeout": 3} and scored.excluded_groups == 1
    assert passing.engine.seeds == stuck.engine.seeds[:2]
    SLOW.clear()


CALLS = {"count": 0}


def slow_on_some(transcripts: list[str], **_: Any) -> list[float]:
    """A length reward, one completion at a time, that overruns its time on calls 0, 1, 2 and 4 of every 8 (a step
    of 2 prompts x 4 samples: the first group keeps 1 sample and leaves, the second keeps 3)."""
    if len(transcripts) > 1:
        raise RuntimeError("one completion at a time")
    k = CALLS["count"]
    CALLS["count"] += 1
    if k % 8 in (0, 1, 2, 4):
        time.sleep(10.0)
    return [len(transcripts[0]) / 10]


class RecordingGRPO(GRPOModule):
    """Records what each packed row was given: its rollouts and their advantages."""

    def pack_rollouts(self, rollouts: list[Rollout], advantages: torch.Tensor) -> Any:
        self.packed.append((list(rollouts), advantages.clone()))
        return super().pack_rollouts(rollouts, advantages)


def test_a_grpo_run_leaves_timed_out_samples_out_of_the_advantages_and_logs_the_counts(tmp_path):
    CALLS["count"] = 0
    L.seed_everything(0, verbose=False)
    module = RecordingGRPO(**{**FAST, "rewards": [RewardSpec("test_infra_failures:slow_on_some")], "reward_timeout_s": 1.0})
    module.packed = []
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, PromptDataModule(batch_size=2))
    assert trainer.global_step == 2 and len(module.packed) == 2
    for rollouts, advantages in module.packed:
        # Only the second prompt's three answered samples are trained, with advantages over those three alone.
        assert len(rollouts) == 3 and {r.group_id for r in rollouts} == {0}
        rewards = torch.tensor([len(visible_text(module.tokenizer, r.completion_ids)) / 10 for r in rollouts])
        by_hand = (rewards - rewards.mean()) / (rewards.std() + STD_EPSILON)
        assert torch.allclose(advantages, by_hand, atol=1e-6)
    with next(tmp_path.glob("**/metrics.csv")).open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/rollouts/excluded")]
    assert [(float(r["train/rollouts/excluded"]), float(r["train/groups/excluded"]), float(r["train/rollouts/excluded/reward_timeout"]))
            for r in rows] == [(4.0, 1.0, 4.0)] * 2  # fmt: skip
    # The reward's own count of the samples its timeouts failed: those left out (it read 0, counted over the rest).
    assert [float(r["train/reward/slow_on_some/timeouts"]) for r in rows] == [4.0, 4.0]
