"""Callbacks every run gets: throughput on the progress bar, summary.json, the final HF export, SLURM requeue.

A module's ``training_step`` returns ``{"loss", "tokens", "flat_tokens"}`` (tokens forwarded, and what
flat packing would have forwarded), and ``reported_loss`` when the ``loss`` it backpropagates is not the
figure to report (SFT backpropagates a sum); a module may add figures to the summary with ``summary_metrics()``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak accelerator memory allocated by torch, or the process's peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process_max_rss"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class RunSummary(Callback):
    """Tracks loss and throughput, shows tokens/s on the progress bar, writes OUTPUT_DIR/summary.json."""

    def __init__(self, output_dir: str | Path, task: str, window: int = 10) -> None:
        self.path = Path(output_dir) / "summary.json"
        self.task = task
        self.window = window
        self.losses: list[float] = []
        self.tokens = 0
        self.flat_tokens = 0
        self.train_seconds = 0.0
        self._batch_start = 0.0
        self._fit_start = 0.0
        self.extra: dict[str, Any] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._batch_start
        self.train_seconds += seconds
        if not isinstance(outputs, dict):
            return
        self.losses.append(float(outputs.get("reported_loss", outputs["loss"])))
        tokens = int(outputs.get("tokens", 0))
        self.tokens += tokens
        self.flat_tokens += int(outputs.get("flat_tokens", tokens))
        pl_module.log("train/tokens_per_s", tokens / max(seconds, 1e-9), prog_bar=True)

    def _mean(self, values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def figures(self, trainer: Trainer) -> dict[str, Any]:
        memory, memory_kind = peak_memory_mb(trainer.strategy.root_device)
        n = min(self.window, max(len(self.losses) // 2, 1))
        return {
            "task": self.task,
            "steps": trainer.global_step,
            "micro_batches": len(self.losses),
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            f"first_{n}_mean_loss": self._mean(self.losses[:n]),
            f"last_{n}_mean_loss": self._mean(self.losses[-n:]),
            "tokens": self.tokens,
            "flat_tokens": self.flat_tokens,
            "tokens_per_s": self.tokens / self.train_seconds if self.train_seconds else None,
            "flat_tokens_per_s": self.flat_tokens / self.train_seconds if self.train_seconds else None,
            "peak_memory_mb": memory,
            "peak_memory_kind": memory_kind,
            "train_seconds": self.train_seconds,
            "wall_seconds": time.perf_counter() - self._fit_start,
            "world_size": trainer.world_size,
        }

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        module_figures = pl_module.summary_metrics() if hasattr(pl_module, "summary_metrics") else {}
        summary = {**self.figures(trainer), **module_figures, **self.extra}
        for key, value in summary.items():
            if isinstance(value, float) and not math.isfinite(value):
                summary[key] = None
        if trainer.is_global_zero:
            write_json_atomic(self.path, summary)


class ExportHuggingFace(Callback):
    """At the end of a completed fit, writes OUTPUT_DIR/hf through the module's ``export_hf`` (every rank takes
    part, so sharded weights can be gathered; the global-zero rank writes)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / "hf"

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if hasattr(pl_module, "export_hf"):
            pl_module.export_hf(self.path, write=trainer.is_global_zero)


class RequeueOnSignal(Callback):
    """SLURM's requeue signal (``--signal=SIGUSR1@90``) handled at an optimizer-step boundary, on every rank at once.

    Lightning's own handler saves a checkpoint from inside the signal handler, wherever each rank happens to be in
    its step. A sharded (FSDP2) checkpoint is a collective, so ranks signalled mid-step would enter it at
    different points, between the all-gathers of their step. Here the handler only records the signal; after
    each optimizer step the ranks agree on it (one all-reduce of a flag), all save together into
    ``OUTPUT_DIR/hpc_ckpt_STEP.ckpt`` (written beside it, then renamed whole), and rank 0 asks SLURM to requeue
    the job. The ranks then wait for the SIGTERM with which SLURM stops the job (training on would only be thrown
    away), and the requeued job's ``--ckpt_path=last`` takes this checkpoint.
    Active only when Lightning detected SLURM with auto-requeue on (the default there).
    """

    def __init__(self, output_dir: str | Path, sigterm_wait_s: float = 300.0) -> None:
        self.output_dir = Path(output_dir)
        self.sigterm_wait_s = sigterm_wait_s
        self.requested = False
        self.active = False
        self.done = False
        self._last_step = -1

    def _signalled(self, signum: int, _frame: Any) -> None:
        self.requested = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registers its own handler just before training starts; this replaces it for the run (Lightning
        # restores the original handlers at teardown).
        environment = getattr(trainer.strategy, "cluster_environment", None)
        self.active = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if self.active:
            signal.signal(environment.requeue_signal, self._signalled)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.active or self.done or trainer.global_step == self._last_step:
            return  # mid-accumulation: no optimizer step yet, nothing consistent to save
        self._last_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        self.done = True
        final = self.output_dir / f"hpc_ckpt_{trainer.global_step}.ckpt"
        staging = final.with_name(final.name + ".tmp")
        trainer.save_checkpoint(staging)
        trainer.strategy.barrier("requeue-checkpoint")
        if trainer.is_global_zero:
            os.replace(staging, final)
            job = os.environ.get("SLURM_JOB_ID", "")
            if os.environ.get("SLURM_ARRAY_JOB_ID"):
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            print(f"requeue signal: checkpoint {final} at step {trainer.global_step}; requeueing job {job}", flush=True)
            try:
                result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                error = (result.stderr.strip() or f"exit code {result.returncode}") if result.returncode else ""
            except OSError as err:  # no scontrol on this node: say so, and let the other ranks go on too
                error = str(err)
            # The requeue's own SIGTERM can reach scontrol too (it runs in the job): that is a success.
            requeued = not error or trainer.received_sigterm
            if not requeued:
                print(f"scontrol requeue {job} failed: {error}; training goes on", flush=True)
        requeued = trainer.strategy.broadcast(requeued if trainer.is_global_zero else None, src=0)
        # Train no further on a job that is being requeued: wait for SLURM's SIGTERM, which ends the run unfinished.
        deadline = time.monotonic() + self.sigterm_wait_s
        while requeued and not trainer.received_sigterm and time.monotonic() < deadline:
            time.sleep(0.1)
