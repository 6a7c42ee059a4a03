"""The same seed, machine and versions give the same GRPO run: the tiny GRPO recipe, three steps, run twice in sync
mode and twice in async mode at staleness 0 (rollouts on the background thread), samples the same completions, scores
the same rewards, takes the same losses and exports the same weights, step by step. Another seed samples others."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_rl.cli import main

# Per step: what the rollouts scored and what the step trained on (timings are left out: they differ run to run).
COMPARED = ("train/reward", "train/reward/math_answer/mean", "train/reward/format/mean", "train/loss", "train/grad_norm",
            "train/entropy", "train/rollout/completion_tokens")  # fmt: skip
MODES = {"sync": (), "async_k0": ("--model.async_mode=true", "--model.max_staleness=0")}


def tiny_grpo(out: Path, *overrides: str) -> dict:
    """Three steps of recipes/tiny/grpo.yaml into ``out``: its per-step figures, rollouts and exported weights."""
    assert main(["run", "recipes/tiny/grpo.yaml", f"--output_dir={out}", "--trainer.max_steps=3", "--checkpoint_every_n_steps=1000",
                 "--trainer.enable_progress_bar=false", "--model.log_rollouts_every_n_steps=1", *overrides]) == 0  # fmt: skip
    (metrics,) = out.glob("csv/version_*/metrics.csv")
    steps = [{key: row[key] for key in ("step", *COMPARED)} for row in csv.DictReader(metrics.open()) if row["train/reward"]]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return {"steps": steps, "rollouts": rollouts, "weights": (out / "hf" / "model.safetensors").read_bytes()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("reproducible")
    return {mode: [tiny_grpo(root / f"{mode}-{i}", *flags) for i in range(2)] for mode, flags in MODES.items()}


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_gives_the_same_rewards_losses_and_weights_step_by_step(runs, mode):
    first, second = runs[mode]
    assert [row["step"] for row in first["steps"]] == ["0", "1", "2"]
    assert any(float(row["train/reward"]) > 0 for row in first["steps"])  # something was scored, so equality says something
    assert first["steps"] == second["steps"]
    assert len(first["rollouts"]) == 3 * 4 * 8  # steps x prompts x G, each completion and its reward
    assert first["rollouts"] == second["rollouts"]
    assert first["weights"] == second["weights"]


def test_async_at_staleness_0_trains_as_sync_does(runs):
    """At staleness 0 the background thread generates each batch from the weights the sync step would use."""
    assert runs["async_k0"][0]["steps"] == runs["sync"][0]["steps"]
    assert runs["async_k0"][0]["rollouts"] == runs["sync"][0]["rollouts"]


def test_another_seed_samples_other_completions(runs, tmp_path):
    other = tiny_grpo(tmp_path / "seed1", "--seed=1")
    completions = lambda run: [row["completion"] for row in run["rollouts"]]  # noqa: E731
    assert completions(other) != completions(runs["sync"][0])
    assert other["weights"] != runs["sync"][0]["weights"]
