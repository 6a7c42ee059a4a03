"""GRPO runs whose rewards or settings are broken: refused before training in one line, stopped at the step a
reward fails on every sample (naming it), or contained (non-finite scores are zeroed, logged, never trained on)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from support.grpo import DIGIT_REWARDS, FAST, LENGTH_REWARD, GradientRecorder, fit, trainer
from lightning_rl.cli import main
from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.data.sft import DataError
from lightning_rl.losses import group_advantages
from lightning_rl.rollout.hf import HFRolloutEngine
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec
from lightning_rl.rewards.scoring import RewardFailedError
from support.paths import REPO


def needs_solution(completions: list[str], solution: list[str]) -> list[float]:
    return [float(c == s) for c, s in zip(completions, solution, strict=True)]


def always_raises(completions: list[str], **_: Any) -> list[float]:
    raise KeyError("score")


def sometimes_non_finite(completions: list[str], **_: Any) -> list[float]:
    return [[math.inf, -math.inf, math.nan, len(c) / 10][i % 4] for i, c in enumerate(completions)]


def test_a_reward_needing_a_column_the_data_lacks_is_refused_before_the_model_loads():
    module = GRPOModule(**FAST, rewards=[RewardSpec("test_grpo_faults:needs_solution")])
    with pytest.raises(DataError) as caught:
        trainer(1).fit(module, PromptDataModule(batch_size=2))
    message = str(caught.value)
    assert "\n" not in message and message.endswith(
        "problems.jsonl: reward 'needs_solution' needs 'solution', which is neither a data column nor a reward argument "
        "(there are: answer, completion_ids, completions, kind, log_extra, log_metric, messages, prompt_messages, prompts, "
        "tool_calls, trainer_state, transcripts)"
    )
    assert module.policy is None and module.engine is None


def test_the_cli_says_a_broken_recipe_in_one_line(tmp_path, capsys):
    recipe = str(REPO / "recipes/tiny/grpo.yaml")
    cases = {
        "--model.tool_timeout_s=0": "tool_timeout_s must be > 0, got 0.0",
        "--model.samples_per_turn=[2, 0]": "samples_per_turn[1] must be >= 1, got 0",
        '--model.rewards=[{"function": "test_grpo_faults:needs_solution"}]': "reward 'needs_solution' needs 'solution'",
        "--model.reward_timeout_s=-1": "reward_timeout_s must be > 0, got -1.0",
        "--model.rewards=[]": "model.rewards: at least one reward function is needed",
    }
    for i, (override, expected) in enumerate(cases.items()):
        assert main(["run", recipe, override, f"--output_dir={tmp_path / str(i)}"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and expected in line, line


def test_tools_with_one_turn_say_no_call_is_run(capsys):
    GRPOModule(**FAST, tools=["lightning_rl.tools.builtin:calculator"])
    assert "note: tools with max_turns=1: the model is shown the tools and its one reply is scored, but no call" in capsys.readouterr().err
    GRPOModule(**FAST, tools=["lightning_rl.tools.builtin:calculator"], max_turns=2)
    assert "note: tools" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tool_timeout_s": 0}, "tool_timeout_s must be > 0, got 0"),
        ({"tool_timeout_s": -1.0}, "tool_timeout_s must be > 0, got -1.0"),
        ({"samples_per_turn": [2, 0]}, r"samples_per_turn\[1\] must be >= 1, got 0"),
        ({"samples_per_turn": [-1]}, r"samples_per_turn\[0\] must be >= 1, got -1"),
        ({"max_turns": 0}, "max_turns must be >= 1, got 0"),
        ({"samples_per_turn": [2]}, "samples_per_turn has 1 entries, but max_turns=1 leaves 0 turn"),
        ({"tools": ["lightning_rl.tools.builtin:calculator"], "max_turns": 2, "samples_per_turn": [2, 2]}, "max_turns=2 leaves 1 turn"),
        ({"sampling": {"max_new_tokens": 0}}, "sampling.max_new_tokens must be >= 1, got 0"),
        ({"sampling": {"temperature": 0}}, "sampling.temperature=0 samples greedily: every completion of a prompt is the same"),
        ({"num_generations": 1}, "num_generations=1: GRPO needs G >= 2"),
        ({"tool_output_max_chars": 0}, "tool_output_max_chars must be >= 1, got 0"),
        ({"max_context_tokens": 0}, "max_context_tokens must be >= 1, got 0"),
        ({"reward_all_failed": "ignore"}, "reward_all_failed must be one of stop, zero, got 'ignore'"),
    ],
)
def test_invalid_settings_are_refused_at_construction(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule(**{**FAST, **settings})


def test_a_reward_failing_on_every_sample_stops_the_run_before_its_step_naming_it():
    module = GRPOModule(**FAST, rewards=[*DIGIT_REWARDS, RewardSpec("test_grpo_faults:always_raises")])
    run = trainer(3)
    with pytest.raises(RewardFailedError, match=r"^step 1: reward 'always_raises' failed on all 8 samples, first: KeyError: 'score'"):
        run.fit(module, PromptDataModule(batch_size=2))
    assert run.global_step == 0  # nothing was trained on the zeros
    assert module.summary_metrics()["reward_failure"] == {"reward": "always_raises", "step": 1, "error": "KeyError: 'score'"}
    # Asked for, the run trains on with 0 for that reward, and says so per step.
    module, run = fit(2, rewards=[*DIGIT_REWARDS, RewardSpec("test_grpo_faults:always_raises")], reward_all_failed="zero")
    assert run.global_step == 2 and module.summary_metrics()["reward_failure"] is None
    assert float(run.callback_metrics["train/reward/always_raises/errors"]) == 8.0
    assert float(run.callback_metrics["train/reward/math_answer/errors"]) == 0.0


def test_infinite_rewards_in_a_run_score_zero_are_logged_and_never_reach_the_advantages():
    recorder = GradientRecorder()
    rewards = [RewardSpec("test_grpo_faults:sometimes_non_finite"), *LENGTH_REWARD]
    module, run = fit(2, callbacks=[recorder], rewards=rewards)
    assert run.global_step == 2
    # 2 of every 4 samples (+-inf); the NaN is a sample the reward does not apply to, as TRL reads it
    assert float(run.callback_metrics["train/reward/sometimes_non_finite/non_finite"]) == 4.0
    assert float(run.callback_metrics["train/reward/sometimes_non_finite/errors"]) == 0.0
    last = module.last_trained
    rewards = torch.tensor(last.rewards)
    assert torch.isfinite(rewards).all()
    assert {e["kind"] for e in last.reward_errors} == {"non_finite"} and len(last.reward_errors) == 4
    advantages = group_advantages(rewards, torch.tensor([r.group_id for r in last.rollouts]), "std")
    assert torch.isfinite(advantages).all() and advantages.abs().sum() > 0
    assert math.isfinite(float(run.callback_metrics["train/loss"]))
    assert recorder.steps and all(torch.isfinite(g).all() for step in recorder.steps for g in step.values())


class ShortContextEngine(HFRolloutEngine):
    """An engine with a context of its own shorter than the model's (a vLLM server's max_model_len)."""

    context_length = 60


def test_a_prompt_that_leaves_no_room_for_the_completion_is_refused_naming_its_line(tmp_path):
    """Past the model's positions an engine fails or samples from positions never trained: one line, no step taken."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "2+2"}\n\n{"prompt": "%s"}\n' % ("1+1 " * 40))  # the long one is on line 3
    cases = ((60, "max_context_tokens", "hf"), (None, "the model's max_position_embeddings", "hf"),
             (None, "the engine's max_model_len", ShortContextEngine))  # fmt: skip
    for limit, said, engine in cases:
        module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD, "max_context_tokens": limit, "sampling": {"max_new_tokens": 8},
                               "engine": engine})  # fmt: skip
        if limit is None and engine == "hf":  # the embedded model's own context, made short
            module.configure_model()
            module.policy.config.max_position_embeddings = 60
        run = trainer(2)
        with pytest.raises(DataError) as caught:
            run.fit(module, PromptDataModule(str(data), batch_size=2))
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"{data}: line 3: the prompt is "), message
        assert f"with sampling.max_new_tokens=8 it does not fit the context of 60 tokens ({said})" in message
        assert run.global_step == 0


def test_a_bad_prompt_no_step_has_drawn_yet_is_refused_before_the_first_step(tmp_path):
    """Prompts were rendered and measured when a batch first drew them: a long or template-refused row surfaced
    hours into a run, or never in a short one. Every text prompt is now rendered once before the first step."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join('{"prompt": "%d+1"}\n' % k for k in range(8)) + '{"prompt": "%s"}\n' % ("1+1 " * 40))
    module = GRPOModule(**{**FAST, "rewards": LENGTH_REWARD, "max_context_tokens": 60, "sampling": {"max_new_tokens": 8}})
    run = trainer(1)
    with pytest.raises(DataError, match=f"^{data}: line 9: the prompt is \\d+ tokens; with sampling.max_new_tokens=8 it does not fit"):
        run.fit(module, PromptDataModule(str(data), batch_size=1))
    assert run.global_step == 0


def test_a_reward_failing_on_every_sample_is_the_same_one_line_in_async_mode(tmp_path, capsys):
    """On the producer thread the user's mistake is raised as it is, not wrapped as a failure of generation."""
    recipe = str(REPO / "recipes/tiny/grpo.yaml")
    said = {}
    for mode in ("false", "true"):
        code = main(["run", recipe, f"--model.async_mode={mode}", '--model.rewards=[{"function": "test_grpo_faults:always_raises"}]',
                     "--model.num_generations=2", "--data.batch_size=2", f"--output_dir={tmp_path / mode}"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        said[mode] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert said["true"] == said["false"] == [
        "error: model.rewards: step 1: reward 'always_raises' failed on all 4 samples, first: KeyError: 'score' (reward_all_failed: zero would "
        "train on with 0 instead)"
    ]
