"""The optimizer both training modules build: AdamW with a per-step learning-rate schedule from transformers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from transformers import get_scheduler

from lightning_rl.data.sft import limited_batches
from lightning_rl.errors import RecipeError

# The transformers schedules that need nothing beyond warmup and the run's length.
LrSchedule = Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt"]
# Those that run over the run's length: past its end transformers' cosine climbs again, so they need a run that ends.
_OVER_THE_RUN = ("linear", "cosine", "cosine_with_restarts", "polynomial")
_POLYNOMIAL_END = 1e-7  # transformers' default lr_end


def check_schedule(lr_schedule: str, learning_rate: float, warmup_steps: int) -> None:
    """What transformers' schedules refuse only once the optimizer is built (a traceback after the run has started),
    or take silently: ``polynomial`` decays to 1e-7 and needs a learning rate above it, and ``constant`` applies no
    warmup."""
    if lr_schedule == "polynomial" and learning_rate <= _POLYNOMIAL_END:
        raise RecipeError(f"learning_rate={learning_rate} is at or below {_POLYNOMIAL_END}, where lr_schedule polynomial ends: "
                          "give a larger learning_rate, or another lr_schedule", "learning_rate")  # fmt: skip
    if lr_schedule == "constant" and warmup_steps:
        raise RecipeError(f"warmup_steps={warmup_steps}, but lr_schedule constant applies no warmup: use constant_with_warmup, or "
                          "warmup_steps: 0", "warmup_steps")  # fmt: skip


def adamw_with_schedule(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    trainer: Trainer,
    *,
    learning_rate: float,
    weight_decay: float,
    lr_schedule: LrSchedule,
    warmup_steps: int,
    betas: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """What ``configure_optimizers`` returns: AdamW and its schedule, stepped every optimizer step."""
    total = run_length(trainer)  # max_steps, else what the epochs come to; -1 or inf: no end
    ends = math.isfinite(total) and total >= 1
    if lr_schedule in _OVER_THE_RUN and not ends:
        raise RecipeError(
            f"trainer.max_steps is {trainer.max_steps} (no end), but lr_schedule {lr_schedule!r} runs over the run's "
            "length: set trainer.max_steps, or use constant or constant_with_warmup", "trainer.max_steps",
        )
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, **({"betas": tuple(betas)} if betas else {}))
    scheduler = get_scheduler(lr_schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=int(total) if ends else 1)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run_length(trainer: Trainer) -> float:
    """The run's optimizer steps, as Lightning's ``estimated_stepping_batches`` counts them, without building the
    training data: Lightning builds it to count an epoch's batches, before a resumed run's checkpoint is restored, and
    the data then started from the wrong place (SFT trained other batches, a GRPO resume stopped). A datamodule with
    ``batches_per_epoch`` says it (None: without end), each epoch's by ``batches_of_epochs`` where it has it; another is
    asked of Lightning."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    if max_epochs is None or max_epochs == -1:
        return float("inf") if max_steps == -1 else max_steps
    count = getattr(trainer.datamodule, "batches_per_epoch", None)
    if count is None:
        return trainer.estimated_stepping_batches
    batches = count()
    if batches is None:
        return float("inf") if max_steps == -1 else max_steps
    epochs = max(max_epochs, 1)  # each epoch's own count, where a datamodule says it (a later one may pack into fewer)
    counts = trainer.datamodule.batches_of_epochs(epochs) if hasattr(trainer.datamodule, "batches_of_epochs") else [batches] * epochs
    steps = sum(math.ceil(limited_batches(trainer, n) / trainer.accumulate_grad_batches) for n in counts)
    return min(steps, max_steps) if max_steps != -1 else steps

