"""Nothing lost, nothing repeated: an asynchronous GRPO run (max_staleness 1, so the rollout queue holds batches
generated ahead) stopped by SIGTERM and by SIGKILL at random moments, each time resumed with ``--ckpt_path=last``,
trains every prompt batch exactly once. The transformers engine; the moments come from a seeded generator."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import torch

from lightning_rl.checkpoints import checkpoint_step
from support.paths import REPO
from support.signalled_runs import Recipe, progress, signal_mid_step, step_seconds, steps_done, wait_until

MAX_STEPS = 10
MAX_STALENESS = 1


def killed_at_a_random_moment(recipe: Recipe, out: Path, rng: random.Random) -> None:
    """Resume the run and SIGKILL every process of it somewhere inside a random step: nothing is saved."""
    proc = recipe.start(out, "--ckpt_path=last")
    wait_until(lambda: progress(out), proc, out)
    after = progress(out)[0][0] + rng.randint(1, 2)
    wait_until(lambda: steps_done(out) >= after, proc, out)
    time.sleep(rng.uniform(0.0, step_seconds(out)))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert steps_done(out) < MAX_STEPS and not (out / "hf").exists()  # it died mid-run


def test_async_grpo_killed_and_signalled_at_random_moments_trains_every_prompt_batch_once(tmp_path, tiny_path):
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--trainer.max_steps={MAX_STEPS}", "--checkpoint_every_n_steps=1",
        "--model.async_mode=true", f"--model.max_staleness={MAX_STALENESS}", "--model.num_generations=4",
        "--model.sampling.max_new_tokens=4", "--data.batch_size=2", "--trainer.enable_progress_bar=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    out, rng = tmp_path / "run", random.Random(23)
    signal_mid_step(recipe, out, rng, signal.SIGTERM, True, resume=False, max_steps=MAX_STEPS)  # saves where it stops
    killed_at_a_random_moment(recipe, out, rng)
    recipe.run(out, "--ckpt_path=last")

    newest = max(out.rglob("*.ckpt"), key=checkpoint_step)
    assert checkpoint_step(newest) == MAX_STEPS
    trained = torch.load(newest, map_location="cpu", weights_only=True)["grpo"]["trained_batches"]
    assert Counter(b["index"] for b in trained) == Counter(range(MAX_STEPS))  # the multiset: each batch once
    assert all(0 <= b["index"] - b["weight_version"] <= MAX_STALENESS for b in trained)
