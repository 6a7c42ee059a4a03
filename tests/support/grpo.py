"""Shared pieces of the GRPO tests: a real Trainer run of GRPOModule on the bundled toy prompts."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from lightning_rl.data.prompts import PromptDataModule
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rewards import RewardSpec

FAST = dict(num_generations=4, sampling={"max_new_tokens": 6}, learning_rate=1e-3, log_rollouts_every_n_steps=0)
DIGIT_REWARDS = [RewardSpec("math_answer"), RewardSpec("format", weight=0.5, kwargs={"pattern": r"\s*\d"})]


def text_length(completions: list[str], **_: Any) -> list[float]:
    """A reward that differs between almost any two samples, so every group carries a gradient."""
    return [len(c) / 10 for c in completions]


def digit_count(completions: list[str], **_: Any) -> list[float]:
    """A second reward, unlike the length: how many digits a completion has."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def length_or_none(completions: list[str], log_metric: Any, **_: Any) -> list[float | None]:
    """The length, None for completions of an odd length (ranks then score different numbers of samples); logs a
    figure every rank logs, in an order of its own, one that rank 0 alone logs, and one named like a count."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    for name in (["shared_b", "shared_a"] if rank else ["shared_a", "shared_b"]):
        log_metric(name, 100.0 * (rank + 1) if name == "shared_a" else 1.0 * (rank + 1))
    if rank == 0:
        log_metric("rank0_only", 7.0)
    log_metric("parse_errors", 2.0)  # named as the library's own counts are, which are summed over the ranks
    return [None if len(c) % 2 else float(len(c)) for c in completions]


def fails_on_rank_zero(completions: list[str], trainer_state: Any, **_: Any) -> list[float]:
    """The length, but raising on every sample of the first rank (a rank whose prompts the function cannot score)."""
    if trainer_state.is_world_process_zero:
        raise ValueError("cannot score rank 0's samples")
    return [len(c) / 10 for c in completions]


LENGTH_REWARD = [RewardSpec("support.grpo:text_length")]


class GradientRecorder(L.Callback):
    """Keeps a copy of every gradient right before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        grads = {n: p.grad.detach() for n, p in pl_module.named_parameters() if p.grad is not None}
        self.steps.append({n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in grads.items()})  # FSDP2's whole


class TrainedRollouts(L.Callback):
    """Records what each step trained on: batch index, weight version, prompts and completions."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        last = pl_module.last_trained
        self.batches.append(
            {
                "index": last.index,
                "weight_version": last.weight_version,
                "prompts": [r["prompt"] for r in last.records],
                "completions": [r.completion_ids for r in last.rollouts],
            }
        )


class SaveWithBatchesAhead(L.Callback):
    """Saves a checkpoint after optimizer step ``step`` of a longer asynchronous run, once the batches ``ahead`` are
    generated and queued (as a stop at that step would find them)."""

    def __init__(self, path: Any, step: int, ahead: set[int]) -> None:
        self.path, self.step, self.ahead = path, step, ahead

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            deadline = time.monotonic() + 60
            while not self.ahead <= set(pl_module.producer._ready) and time.monotonic() < deadline:
                time.sleep(0.01)
            trainer.save_checkpoint(self.path)


def trainer(max_steps: int, callbacks: list[L.Callback] | None = None, **kwargs: Any) -> L.Trainer:
    return L.Trainer(**{
        "max_steps": max_steps, "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "callbacks": callbacks or [], **kwargs,
    })


def fit(max_steps: int, callbacks: list[L.Callback] | None = None, batch_size: int = 2, ckpt_path: str | None = None,
        **module_kwargs: Any) -> tuple[GRPOModule, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = GRPOModule(**{**FAST, "rewards": DIGIT_REWARDS, **module_kwargs})
    run = trainer(max_steps, callbacks)
    run.fit(module, PromptDataModule(batch_size=batch_size), ckpt_path=ckpt_path)
    return module, run
