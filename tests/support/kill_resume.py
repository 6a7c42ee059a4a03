"""Nothing lost, nothing repeated: a GRPO run stopped by SIGTERM, then SIGKILLed, at random moments, each time
resumed with ``--ckpt_path=last``, trains every prompt batch exactly once (`stopped_killed_and_resumed`), whatever
its engine; and a callback that records the weight versions of every token trained, to show that sequences spanned
weight updates."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lightning_rl.checkpoints import checkpoint_step
from support.signalled_runs import Recipe, progress, signal_mid_step, step_seconds, steps_done, wait_until


class TokenVersions(Callback):
    """Appends, for each trained batch, its index and each rollout's token versions and completion to
    $TOKEN_VERSIONS_FILE."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scored = pl_module.last_trained
        with open(os.environ["TOKEN_VERSIONS_FILE"], "a") as f:
            f.write(json.dumps({"index": scored.index, "versions": [r.versions for r in scored.rollouts],
                                "completions": [r.completion_ids for r in scored.rollouts]}) + "\n")


def killed_at_a_random_moment(recipe: Recipe, out: Path, rng: random.Random, max_steps: int) -> None:
    """Resume the run and SIGKILL every process of it somewhere inside a random step: nothing is saved."""
    proc = recipe.start(out, "--ckpt_path=last")
    wait_until(lambda: progress(out), proc, out)
    first = progress(out)[0][0]
    after = max(first, min(first + rng.randint(1, 2), max_steps - 3))  # a step or two in, with steps left to kill in
    wait_until(lambda: steps_done(out) >= after, proc, out)
    # A step's length needs two finished steps; when the resume starts so late that the kill must follow its first
    # step (after == first), only one is known, and the kill lands at the start of the next step.
    time.sleep(rng.uniform(0.0, step_seconds(out)) if len(progress(out)) > 1 else 0.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert steps_done(out) < max_steps and not (out / "hf").exists()  # it died mid-run


def stopped_killed_and_resumed(recipe: Recipe, out: Path, rng: random.Random, max_steps: int, max_staleness: int) -> None:
    """SIGTERM (it saves where it stops), resume, SIGKILL (nothing saved), resume to the end: the last checkpoint's
    trained batches are each prompt batch once (the multiset), none staler than `max_staleness`."""
    signal_mid_step(recipe, out, rng, signal.SIGTERM, True, resume=False, max_steps=max_steps)
    killed_at_a_random_moment(recipe, out, rng, max_steps)
    recipe.run(out, "--ckpt_path=last")

    newest = max(out.rglob("*.ckpt"), key=checkpoint_step)
    assert checkpoint_step(newest) == max_steps
    trained = torch.load(newest, map_location="cpu", weights_only=True)["grpo"]["per_rank"][0]["trained_batches"]
    assert Counter(b["index"] for b in trained) == Counter(range(max_steps))  # the multiset: each batch once
    assert all(0 <= b["index"] - b["weight_version"] <= max_staleness for b in trained)
