"""Reward functions written for TRL 1.16's `GRPOTrainer` run unchanged: the same arguments in the same shapes
(checked against TRL's own `_calculate_rewards` on the same batch), async functions, None for "does not apply"
(left out of the means, the sum and the advantages as TRL's own code does), `log_extra`/`log_metric`, and short real
runs, synchronous, asynchronous and with tools."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import textwrap
import typing
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.grpo import FAST, fit, trainer
from support.prompt_sources import PromptList
from support.tool_model import train_tool_calling_model
from transformers import TrainerState as HFTrainerState
from trl import GRPOTrainer  # the reference: trl==1.16.0 from the dev extra

from lightning_rl.data.prompts import PromptDataModule, PromptRenderer
from lightning_rl.losses.advantages import group_advantages, normalize_then_sum
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.modules.grpo_metrics import batch_metrics
from lightning_rl.rewards import RewardScorer, RewardSpec, TrainerState
from lightning_rl.rollout.base import Rollout, SamplingConfig
from lightning_rl.rollout.buffer import ScoredBatch
from lightning_rl.rollout.collector import RolloutCollector, RolloutSettings
from lightning_rl.rollout.hf import HFRolloutEngine
from lightning_rl.toy.task import PROBLEMS_FILE

# --- Reward functions as TRL's documentation writes them ---------------------------------------------------------


def reply_length(completions, **kwargs):
    """Conversational: each completion is a list of messages; the reply is the first one's content."""
    return [-abs(2 - len(completion[0]["content"])) / 10 for completion in completions]


async def exact_answer(completions, answer, **kwargs):
    """An async reward (an LLM judge would await here): the last message against the `answer` column."""
    await asyncio.sleep(0)
    return [float(completion[-1]["content"].strip() == a) for completion, a in zip(completions, answer)]


def max_only(completions, kind, **kwargs):
    """A multi-task reward: None where it does not apply."""
    return [float(completion[-1]["content"].strip().isdigit()) if k == "max" else None for completion, k in zip(completions, kind)]


def plain_length(prompts, completions, **kwargs):
    """Standard (plain-text) format: prompts and completions are strings."""
    return [len(completion) / 10 for completion in completions]


CALLS: list[dict[str, Any]] = []  # what `recorded` was called with, call after call


def recorded(prompts, completions, completion_ids, trainer_state, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "state": trainer_state, **kwargs})  # fmt: skip
    return [0.0] * len(completions)


def logs_extras(completions, log_extra, log_metric, **kwargs):
    log_extra("chars", [len(json.dumps(c)) for c in completions])
    log_metric("batch_size", len(completions))
    if any("boom" in json.dumps(c) for c in completions):
        raise RuntimeError("boom")
    return [1.0] * len(completions)


# --- The same batch through TRL's own reward call ----------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Reply with the answer only."}
CONVERSATIONAL = dict(
    prompts=[[SYSTEM, {"role": "user", "content": "86+9="}]] * 2 + [[SYSTEM, {"role": "user", "content": "max 9 4"}]] * 2,
    completions=[[{"role": "assistant", "content": text}] for text in ["95", "96 ", "9", "x"]],
    columns={"answer": ["95", "95", "9", "9"], "kind": ["add", "add", "max", "max"]},
    completion_ids=[[57, 53, 2], [57, 54, 5, 2], [57], [88, 2]],
)


def _trl_rewards(functions, inputs, prompts, completions, completion_ids, state) -> torch.Tensor:
    """TRL's `_calculate_rewards` itself, on a trainer holding only what that method reads."""
    from accelerate import Accelerator
    from trl.trainer.utils import start_event_loop_in_daemon

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    _, loop, ready = start_event_loop_in_daemon(name="trl rewards")
    ready.wait()
    trainer.__dict__.update(
        accelerator=Accelerator(cpu=True), args=SimpleNamespace(report_to=[]), state=state, reward_funcs=functions,
        reward_processing_classes=[None] * len(functions), reward_func_names=[f.__name__ for f in functions],
        environments=None, async_loop=loop, _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list),
    )  # fmt: skip
    try:
        return trainer._calculate_rewards(inputs, prompts, completions, completion_ids)
    finally:
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("conversational", [True, False])
def test_reward_functions_get_what_trl_passes_them(conversational):
    batch = dict(CONVERSATIONAL)
    text_prompts = ["<rendered>" + p[-1]["content"] for p in batch["prompts"]]
    text_completions = [c[0]["content"] for c in batch["completions"]]
    if conversational:
        functions = [recorded, reply_length, exact_answer, max_only]
        ours = dict(chat_prompts=batch["prompts"], chat_completions=batch["completions"])
        trl_prompts, trl_completions = batch["prompts"], batch["completions"]
    else:
        functions = [recorded, plain_length]
        ours = {}
        trl_prompts, trl_completions = text_prompts, text_completions
    columns = {**batch["columns"], "completion_ids": batch["completion_ids"], "transcripts": text_completions}
    CALLS.clear()
    scorer = RewardScorer([RewardSpec(f) for f in functions])
    scores = scorer.score(text_prompts, text_completions, columns, **ours, trainer_state=TrainerState(3, 10, 0.75))
    state = HFTrainerState(global_step=3, max_steps=10, epoch=0.75)
    inputs = [{"prompt": p, **{k: v[i] for k, v in batch["columns"].items()}} for i, p in enumerate(trl_prompts)]
    theirs = _trl_rewards(functions, inputs, trl_prompts, trl_completions, batch["completion_ids"], state)
    mine, trl = CALLS
    # Every argument TRL passes comes, equal, under its name; ours come on top under their own.
    assert set(mine) - set(trl) == {"transcripts"}
    for key in set(trl) - {"state", "log_extra", "log_metric"}:
        assert mine[key] == trl[key], key
    for name in ("global_step", "max_steps", "epoch", "is_world_process_zero", "is_local_process_zero"):
        assert getattr(mine["state"], name) == getattr(trl["state"], name)
    with pytest.raises(AttributeError, match=r"trainer_state has global_step, .*; transformers' TrainerState.log_history is not given"):
        mine["state"].log_history  # a reward reading it fails in one line naming what it has
    assert callable(mine["log_extra"]) and callable(mine["log_metric"])
    if conversational:
        assert mine["completions"][1] == [{"role": "assistant", "content": "96 "}] and isinstance(mine["prompts"][0], list)
    else:
        assert mine["prompts"] == text_prompts and mine["completions"] == text_completions
    per_function = torch.stack([scores.per_function[f.__name__] for f in functions], 1)
    torch.testing.assert_close(per_function, theirs, equal_nan=True)
    assert math.isnan(theirs[0, 3]) if conversational else True  # None is NaN in TRL too
    torch.testing.assert_close(scores.total, theirs.nansum(1))


def reply_digits(completions: list[str], **kwargs) -> list[float]:
    return [float(sum(ch.isdigit() for ch in completion)) for completion in completions]


def reply_digits_unpostponed(completions, **kwargs):
    return reply_digits(completions)


reply_digits_unpostponed.__annotations__ = {"completions": typing.Sequence[str]}  # as without `from __future__`


def test_functions_annotated_as_text_and_builtins_read_text_beside_trl_style_ones():
    specs = [RewardSpec("math_answer"), RewardSpec(exact_answer), RewardSpec(reply_digits), RewardSpec(reply_digits_unpostponed)]
    batch = CONVERSATIONAL
    texts = [c[0]["content"] for c in batch["completions"]]
    scores = RewardScorer(specs).score(
        ["p"] * 4, texts, batch["columns"], chat_prompts=batch["prompts"], chat_completions=batch["completions"]
    )
    assert scores.per_function["math_answer"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.per_function["exact_answer"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.per_function["reply_digits"].tolist() == scores.per_function["reply_digits_unpostponed"].tolist() == [2, 2, 1, 0]
    assert not scores.errors


def _trl_advantages(per_function: torch.Tensor, weights: torch.Tensor, aggregation: str, scale: str, G: int) -> torch.Tensor:
    """TRL's own lines, from its unscorable mask to its advantages, run on these rewards."""
    from trl.trainer.utils import nanstd

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.rindex("\n", 0, source.index("unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)")) + 1
    end = source.index("\n", source.index("advantages = torch.nan_to_num(advantages, nan=0.0)"))
    trainer = SimpleNamespace(multi_objective_aggregation=aggregation, scale_rewards=scale, reward_weights=weights,
                              reward_funcs=[None] * weights.numel())  # fmt: skip
    scope = {"self": trainer, "torch": torch, "nanstd": nanstd, "rewards_per_func": per_function, "device": "cpu",
             "num_generations": G}  # fmt: skip
    exec(textwrap.dedent(source[start:end]), scope)
    return scope["advantages"]


@pytest.mark.parametrize(
    "aggregation,scale",
    [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"), ("sum_then_normalize", "none"),
     ("normalize_then_sum", "group")],
)  # fmt: skip
def test_none_is_left_out_of_the_sum_the_means_and_the_advantages_as_in_trl(aggregation, scale):
    G, pattern = 4, torch.Generator().manual_seed(5)
    values = torch.randn(3 * G, 2, generator=pattern)
    applies = torch.ones(3 * G, 2, dtype=torch.bool)
    applies[[0, 9], 0] = applies[[2, 11], 1] = False
    applies[1] = False  # a sample no function applies to
    applies[G : 2 * G, 1] = False  # a function that applies to no sample of a group
    table = [[float(v) if a else None for v, a in zip(row, mask)] for row, mask in zip(values.tolist(), applies.tolist())]

    def first(completions, **_):
        return [row[0] for row in table]

    async def second(completions, **_):
        return [row[1] for row in table]

    weights = torch.tensor([1.0, 0.5])
    scores = RewardScorer([RewardSpec(first), RewardSpec(second, weight=0.5)]).score(["p"] * 3 * G, ["c"] * 3 * G, {})
    per_function = torch.stack([scores.per_function["first"], scores.per_function["second"]], 1)
    assert per_function.isnan().equal(~applies) and not scores.errors
    assert math.isnan(scores.total[1]) and scores.total.isnan().sum() == 1
    torch.testing.assert_close(scores.total[~scores.total.isnan()], (per_function * weights).nansum(1)[~scores.total.isnan()])
    groups = torch.arange(3).repeat_interleave(G)
    if aggregation == "normalize_then_sum":
        ours = normalize_then_sum(per_function, weights, groups)
    else:
        ours = group_advantages(scores.total, groups, scale)
    theirs = _trl_advantages(per_function, weights, aggregation, scale, G)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours[1] == 0
    # The logged means leave them out too (TRL: nanmean over the samples a function applied to).
    rollouts = [Rollout([1], [2], [0.0], 0, int(g)) for g in groups]
    scored = ScoredBatch(0, [], rollouts, scores.total.tolist(), {k: v.tolist() for k, v in scores.per_function.items()})
    metrics = batch_metrics(scored, with_tools=False)
    torch.testing.assert_close(metrics["reward/second/mean"], per_function[:, 1].nanmean())
    torch.testing.assert_close(metrics["reward/mean"], scores.total.nanmean())
    assert metrics["reward/unscored"] == 1.0


def test_log_extra_and_log_metric_reach_the_table_and_the_metrics():
    completions = [[{"role": "assistant", "content": c}] for c in ["a", "boom", "cc"]]
    scores = RewardScorer([RewardSpec(logs_extras)]).score(
        ["p"] * 3, ["a", "boom", "cc"], {}, chat_prompts=[[SYSTEM]] * 3, chat_completions=completions
    )
    # The batch call raised; each sample was then scored alone, logging its own value in its place.
    assert scores.total.tolist() == [1.0, 0.0, 1.0] and len(scores.errors) == 1
    assert scores.logged_columns == {"chars": [len(json.dumps(c)) for c in completions]}
    assert scores.logged_metrics == {"batch_size": [3.0, 1.0, 1.0, 1.0]}

    def wrong_length(completions, log_extra, **_):
        log_extra("x", [1, 2, 3])
        return [1.0] * len(completions)

    failed = RewardScorer([RewardSpec(wrong_length)], all_failed="zero").score(["p"] * 2, ["a", "b"], {})
    assert [e.error for e in failed.errors] == ["ValueError: log_extra('x'): 3 values for 1 completions"] * 2


def test_the_rollout_table_keeps_its_own_columns_when_a_reward_or_its_log_shares_their_names():
    """A reward named ``reward`` replaced the weighted total, and a logged ``step`` column the step a resume's
    rewrite of rollouts.jsonl goes by (it then dropped the earlier steps' rows)."""
    from lightning_rl.modules.grpo_metrics import rollout_table

    rollouts = [Rollout([1, 2], [3], [-0.5], 0, 0), Rollout([1, 2], [4], [-0.5], 0, 0)]
    scored = ScoredBatch(index=3, records=[{"prompt": "p"}], rollouts=rollouts, rewards=[2.0, 0.0],
                         reward_terms={"reward": [1.0, 0.0]}, logged_columns={"step": ["parsed", "parsed"], "reward": [5, 6]})  # fmt: skip
    columns, rows = rollout_table(scored, str, step=7, advantages=[0.5, -0.5])
    table = [dict(zip(columns, row, strict=True)) for row in rows]
    assert columns[7:] == ["reward/reward", "extra/step", "extra/reward"] and [t["advantage"] for t in table] == [0.5, -0.5]
    assert [(t["step"], t["reward"], t["reward/reward"], t["extra/step"], t["extra/reward"]) for t in table] == [
        (7, 2.0, 1.0, "parsed", 5), (7, 0.0, 0.0, "parsed", 6)]


# --- Short real runs ----------------------------------------------------------------------------------------------

TRL_STYLE = [RewardSpec(reply_length), RewardSpec(exact_answer), RewardSpec(max_only), RewardSpec(recorded, weight=0.0)]


@pytest.mark.parametrize("async_mode", [False, True])
def test_trl_style_rewards_train_sync_and_async(async_mode):
    CALLS.clear()
    module, run = fit(2, async_mode=async_mode, max_staleness=1, rewards=TRL_STYLE)
    assert [c["state"].global_step for c in CALLS] == list(range(len(CALLS))) and len(CALLS) >= 2  # async: ahead
    assert {c["state"].max_steps for c in CALLS} == {2}
    toy = [json.loads(line) for line in PROBLEMS_FILE.read_text().splitlines()]
    assert CALLS[1]["state"].epoch == 2 / len(toy)  # 2 prompts per step
    prompts = [record["messages"][:-1] for record in toy]
    for call in CALLS:
        assert all(p in prompts for p in call["prompts"])  # the data's messages, as TRL passes them
        assert all(c == [{"role": "assistant", "content": c[0]["content"]}] for c in call["completions"])
        assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in call["completion_ids"])
        assert set(call) >= {"answer", "kind", "messages", "tool_calls", "transcripts", "prompt_messages"}
    terms = module.last_trained.reward_terms
    kinds = [record["kind"] for record in module.last_trained.records for _ in range(4)]
    assert [math.isnan(v) for v in terms["max_only"]] == [k != "max" for k in kinds]
    assert math.isfinite(float(run.callback_metrics["train/reward/mean"]))


def test_trl_style_rewards_on_plain_text_prompts(tmp_path):
    data = tmp_path / "plain.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    CALLS.clear()
    module = GRPOModule(**{**FAST, "rewards": [RewardSpec(plain_length), RewardSpec(recorded, weight=0.0)]})
    trainer(2).fit(module, PromptDataModule(str(data), batch_size=2))
    assert len(CALLS) == 2
    for call in CALLS:
        assert all(isinstance(p, str) and "+1=" in p for p in call["prompts"])
        assert all(isinstance(c, str) for c in call["completions"])


def test_trl_style_rewards_read_tool_turns_as_trl_shapes_them():
    model, tokenizer, _, _ = train_tool_calling_model()
    records = [{"prompt": [{"role": "user", "content": "7+5="}], "answer": "12"},
               {"prompt": [{"role": "user", "content": "7+1="}], "answer": "8"}]  # fmt: skip
    settings = RolloutSettings(num_generations=2, tools=("lightning_rl.tools.builtin:calculator",), max_turns=2)
    scorer = RewardScorer([RewardSpec(exact_answer), RewardSpec("tool_call_validity"), RewardSpec(recorded)])
    renderer = PromptRenderer(tokenizer)  # the prompts as the model learned them, without the tools' schemas
    collector = RolloutCollector(
        HFRolloutEngine(model), PromptList(records), renderer, scorer, SamplingConfig(max_new_tokens=48, temperature=0),
        settings, max_steps=7,
    )
    CALLS.clear()
    try:
        scored = collector.collect(0)
    finally:
        collector.close()
    (call,) = CALLS
    good, bad = call["completions"][0], call["completions"][2]
    assert [m["role"] for m in good] == ["assistant", "tool", "assistant"] == [m["role"] for m in bad]
    assert good[0]["tool_calls"] == [{"type": "function", "function": {"name": "calculator",  # as written: the run coerced "7"
                                                                       "arguments": {"operation": "add", "a": "7", "b": 5}}}]
    assert good[1] == {"role": "tool", "name": "calculator", "content": "12"} and good[2] == {"role": "assistant", "content": "12"}
    assert call["prompts"][0] == records[0]["prompt"] and call["state"].max_steps == 7
    assert scored.reward_terms["exact_answer"] == [1.0, 1.0, 1.0, 1.0]
    assert scored.reward_terms["tool_call_validity"] == [1.0, 1.0, 0.0, 0.0]  # a built-in, reading text, beside it


def test_trl_style_rewards_in_a_run_with_tools():
    CALLS.clear()
    module, _ = fit(2, tools=["lightning_rl.tools.builtin:calculator"], max_turns=2, rewards=TRL_STYLE)
    assert len(CALLS) == 2
    for call in CALLS:
        for completion in call["completions"]:
            roles = [m["role"] for m in completion]
            assert roles[0] == roles[-1] == "assistant" and set(roles) <= {"assistant", "tool"}
            for before, message in zip(completion, completion[1:]):  # a tool answers the turn that called it
                assert message["role"] == "assistant" or "tool_calls" in before or before["role"] == "tool"
