"""Stop signals that find the run somewhere other than its own training step, through real `lightning-rl run`s:
DataLoader worker processes (a scheduler signals the whole process group), and a reward that does not return."""

from __future__ import annotations

import random
import signal

from support.paths import REPO
from support.signalled_runs import Recipe, log_of, signal_mid_step

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
