"""Reward functions: built-ins, dotted paths, async functions, weights, and failures that score 0."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lightning_rl.rewards import RewardScorer, RewardSpec
from lightning_rl.rewards.builtin import extract_answer, format_match, math_answer, tool_call_validity


def test_math_answer_reads_boxed_tags_or_the_last_number():
    assert extract_answer("so \\boxed{12} it is") == "12"
    assert extract_answer("<answer> 7 </answer> and 9") == "7"
    assert extract_answer("3 then 4.5") == "4.5"
    assert extract_answer("no digits") is None
    completions = ["54", "it is 54.0", "\\boxed{3}", "1 7 0 4", "1 7 0", "55"]
    answers = ["54", "54", "3", "1 7 0 4", "1 7 0 4", "54"]
    assert math_answer(completions, answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_format_and_tool_call_validity():
    assert format_match(["<answer>1</answer>", "x <answer>1</answer>"]) == [1.0, 0.0]
    assert format_match(["12", "a1"], pattern=r"\d+$") == [1.0, 0.0]
    calls = [[{"failure": None}, {"failure": "invalid_arguments"}], [], [{"failure": None}]]
    assert tool_call_validity(["", "", ""], calls) == [0.5, 0.0, 1.0]
    assert tool_call_validity(["", "", ""], calls, no_call_score=1.0)[1] == 1.0


def length_bonus(completions, **_):
    return [len(c) / 10 for c in completions]


async def slow_exact(completions, answer, **_):
    await asyncio.sleep(0.01)
    return [float(c == a) for c, a in zip(completions, answer)]


def picky(completions, **_):
    for c in completions:
        if "boom" in c:
            raise RuntimeError("cannot score boom")
    return [1.0] * len(completions)


def test_weighted_sum_of_builtin_dotted_path_and_async_functions():
    scorer = RewardScorer([
        RewardSpec("math_answer", weight=2.0),
        RewardSpec("test_rewards:length_bonus", weight=0.5),
        RewardSpec(slow_exact, name="exact"),
    ])
    scores = scorer.score(["q1", "q2"], ["4", "five"], {"answer": ["4", "5"]})
    assert scores.per_function["math_answer"].tolist() == [1.0, 0.0]
    assert scores.per_function["length_bonus"].tolist() == pytest.approx([0.1, 0.4])
    assert scores.per_function["exact"].tolist() == [1.0, 0.0]
    assert scores.total.tolist() == pytest.approx([2.0 + 0.05 + 1.0, 0.2])
    assert scores.errors == []


def test_a_raising_reward_scores_only_the_failing_sample_zero_and_is_logged(caplog):
    scorer = RewardScorer([RewardSpec(picky), RewardSpec("math_answer")])
    with caplog.at_level(logging.WARNING):
        scores = scorer.score(["a", "b", "c"], ["1", "boom", "3"], {"answer": ["1", "2", "3"]})
    assert scores.per_function["picky"].tolist() == [1.0, 0.0, 1.0]
    assert scores.total.tolist() == [2.0, 0.0, 2.0]
    (error,) = scores.errors
    assert (error.function, error.sample, error.completion) == ("picky", 1, "boom")
    assert "RuntimeError: cannot score boom" in error.error
    assert "reward 'picky' failed on sample 1" in caplog.text


def test_a_raising_reward_can_be_made_fatal():
    scorer = RewardScorer([RewardSpec(picky)], on_error="raise")
    with pytest.raises(RuntimeError, match="cannot score boom"):
        scorer.score(["a"], ["boom"], {})


def test_wrong_number_of_scores_counts_as_a_failure():
    scorer = RewardScorer([RewardSpec(lambda completions, **_: [1.0], name="short")])
    scores = scorer.score(["a", "b"], ["x", "y"], {})
    assert scores.total.tolist() == [1.0, 1.0]  # retried one sample at a time, where it is right
    scorer = RewardScorer([RewardSpec(lambda completions, **_: [], name="empty")])
    scores = scorer.score(["a"], ["x"], {})
    assert scores.total.tolist() == [0.0] and "returned 0 scores for 1 completions" in scores.errors[0].error


def test_bad_reward_specs_are_refused_by_name():
    with pytest.raises(ValueError, match="neither a built-in"):
        RewardScorer([RewardSpec("nonsense")])
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        RewardScorer([RewardSpec("no_such_module.fn")])
    with pytest.raises(ValueError, match="names must be unique"):
        RewardScorer([RewardSpec("math_answer"), RewardSpec("math_answer")])
