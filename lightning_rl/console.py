"""What a run prints: a progress bar by optimizer step, and filters for third-party noise that says nothing about it."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

# Short names for the figures modules show on the bar (``self.log(..., prog_bar=True)``).
_SHORT = {"train/tokens_per_s": "tok/s", "train/loss": "loss", "train/reward": "reward", "val/loss": "val_loss"}


class StepProgressBar(TQDMProgressBar):
    """The optimizer step out of the run's total (``max_steps``, or what the epochs come to), with tokens/s and the
    loss (SFT) or reward (GRPO) under short names; one bar across epochs, which a step-based run does not count."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.train_progress_bar.set_description("step")
        self.train_progress_bar.reset(total=convert_inf(trainer.estimated_stepping_batches))
        self.train_progress_bar.n = trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.refresh()

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # no per-epoch bar: the bar counts optimizer steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is None or trainer.global_step == bar.n or not self._should_update(trainer.global_step, bar.total):
            return
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return {_SHORT.get(name, name.removeprefix("train/")): value for name, value in metrics.items()}


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_third_party_noise() -> None:
    """Lightning's advertising tips, its hint to use ``srun`` on any machine where SLURM is installed, deprecation
    warnings raised inside libraries by their own calls, two warnings about GRPO's own design, and the non-empty
    checkpoint folder the CLI has already ruled on: none is about the user's run."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Both about GRPO's own design, not the user's run: its reference model is frozen in eval mode, and its step
    # (manual optimization) is checkpointed after the optimizer step on purpose.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps")
    # The run folder is checked by the CLI itself (a folder with outputs is resumed or replaced, never mixed), before
    # Lightning looks: its warning about a non-empty checkpoint folder would only ever describe a resume or --overwrite.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
