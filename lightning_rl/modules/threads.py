"""Intra-op threads when a rollout thread samples on the CPU beside the trainer, in one process.

torch's intra-op thread count is process-wide, and every thread that runs an op runs a team of that many: an async GRPO
run whose transformers engine samples on the CPU while the trainer trains there runs two full teams on the cores. Teams
that outnumber the cores wait on each other's descheduled threads (on a loaded 2-core machine the tiny SFT recipe ran
30 steps in 140-214 s with torch's two threads and 12-19 s with one). Each side gets its share instead. Several
processes on a CPU are Lightning's business (its launcher sets OMP_NUM_THREADS to each process's share), and a user's
OMP_NUM_THREADS is left as it is.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch import Trainer

from lightning_rl.rollout.hf import HFRolloutEngine


def share_cores_with_rollouts(engine: object, trainer: Trainer, max_staleness: int) -> int | None:
    """Halve torch's intra-op threads for a run of one process whose transformers engine samples on the CPU, on a
    thread of its own, while the trainer trains on the CPU; the threads each side now has, or None where nothing was
    changed (OMP_NUM_THREADS set, several processes, either side off the CPU, or ``max_staleness`` 0: the rollout thread
    then samples only between two steps, and the run keeps the threads, hence the sums, of a sync run)."""
    on_cpu = trainer.strategy.root_device.type == "cpu" and isinstance(engine, HFRolloutEngine) and engine.device.type == "cpu"
    if "OMP_NUM_THREADS" in os.environ or trainer.world_size > 1 or not on_cpu or max_staleness == 0:
        return None
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    torch.set_num_threads(threads)
    return threads
