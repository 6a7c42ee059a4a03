"""Stop signals that find the run somewhere other than its own training step, through real `lightning-rl run`s:
DataLoader worker processes (a scheduler signals the whole process group), and a reward that does not return."""

from __future__ import annotations

import os
import random
import signal

import torch

from lightning_rl.checkpoints import checkpoint_step
from support.paths import REPO
from support.recipe_runs import exported
from support.signalled_runs import Recipe, exit_after_signal, log_of, progress, signal_mid_step, wait_until

WORKER_STEPS = 10


def test_a_signal_to_the_whole_group_leaves_the_dataloader_workers_to_the_main_process(tiny_path, tmp_path):
    """SIGTERM, then SIGUSR1, to every process of an SFT run with 2 DataLoader workers (forked anew every epoch of the
    toy data, a few steps): each time the run saves at the step boundary and exits 143, and the second run resumes from the
first one's checkpoint."""
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "sft.yaml"), "--data.num_workers=2", "--data.val_data=null", "--model.eval_generations=0",
        "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", f"--trainer.max_steps={WORKER_STEPS}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    out, rng = tmp_path / "run", random.Random(21)
    first = signal_mid_step(recipe, out, rng, signal.SIGTERM, to_group=True, resume=False, max_steps=WORKER_STEPS)
    second = signal_mid_step(recipe, out, rng, signal.SIGUSR1, to_group=True, resume=True, max_steps=WORKER_STEPS)
    log = log_of(out)
    assert first < second and f"resume: step {first} from hpc_ckpt_{first}.ckpt, the newest complete checkpoint" in log
    assert "Traceback" not in log and "DataLoader worker" not in log


GRPO_STEPS = 5


def test_a_signal_does_not_wait_for_a_reward_that_does_not_return(tiny_path, tmp_path, monkeypatch):
    """A GRPO run whose reward never returns on step 3 (its timeout an hour): SIGTERM ends it within seconds, exit 143,
    with the checkpoint of step 2; the resume trains step 3 once and ends with the weights of an uninterrupted run."""
    recipe = Recipe([
        str(REPO / "recipes" / "tiny" / "grpo.yaml"), f"--trainer.max_steps={GRPO_STEPS}", "--model.num_generations=4",
        "--data.batch_size=2", '--model.rewards=[{"function": "support.signalled_runs:length_until_stuck"}]',
        "--model.reward_timeout_s=3600", "--trainer.enable_progress_bar=false", "--logger.kind=none",
    ], ranks=1)  # fmt: skip
    reference, out, marker = tmp_path / "reference", tmp_path / "run", tmp_path / "stuck"
    recipe.run(reference)

    monkeypatch.setenv("STUCK_REWARD_CALL", "3")
    monkeypatch.setenv("STUCK_REWARD_MARKER", str(marker))
    proc = recipe.start(out)
    wait_until(marker.exists, proc, out, poll=0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    code, seconds = exit_after_signal(proc, out, "SIGTERM during a reward that does not return")
    log = log_of(out)
    assert code == 143, log[-3000:]
    assert seconds < 15, "the stop waited for the reward"
    stopped = [line for line in log.splitlines() if line.startswith("stopped by")]
    assert stopped == ["stopped by SIGTERM after step 2 (step 3 given up: reward 'length_until_stuck' had not returned); "
                       "resume with --ckpt_path=last"], log[-3000:]  # fmt: skip
    assert "Traceback" not in log and not (out / "hf").exists()
    assert sorted(out.glob("hpc_ckpt_*.ckpt")) == [out / "hpc_ckpt_2.ckpt"] and checkpoint_step(out / "hpc_ckpt_2.ckpt") == 2

    monkeypatch.delenv("STUCK_REWARD_CALL")
    log = recipe.run(out, "--ckpt_path=last")
    assert "resume: step 2 from hpc_ckpt_2.ckpt, the newest complete checkpoint" in log
    assert [step for step, _ in progress(out)] == [3, 4, 5]  # the abandoned step trained once, none skipped
    want, got = exported(reference), exported(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
