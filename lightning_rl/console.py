"""What a run prints: progress by optimizer step (a bar on a terminal, a plain line every few steps in a log file), and
filters for third-party noise that says nothing about it."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

# The figures progress shows, in this order and under these short names, when the run logs them (SFT: loss; GRPO:
# reward, KL to the reference, the clipped fraction of tokens), whether or not they were logged with ``prog_bar``.
_SHORT = {
    "train/loss": "loss",
    "train/reward": "reward",
    "train/kl": "kl",
    "train/mismatch/kl": "mis_kl",  # engine vs trainer on the sampled tokens: about 0 when they agree
    "train/clip/fraction": "clip",
    "train/lr": "lr",
    "train/tokens_per_s": "tok/s",
    "val/loss": "val_loss",
    "val/exact_match": "val_exact_match",
}


def _number(value: float) -> str:
    return f"{value:.3g}" if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5) else f"{value:.4g}"


class StepProgressBar(TQDMProgressBar):
    """The optimizer step out of the run's total (``max_steps``, or what the epochs come to), with the figures of
    ``_SHORT``; one bar across epochs, which a step-based run does not count.

    When the output is not a terminal (a SLURM log, ``| tee``), carriage returns would make the whole run one line:
    progress is then one plain line every ``trainer.log_every_n_steps`` optimizer steps and at the last one.
    """

    def __init__(self, terminal: bool | None = None) -> None:
        super().__init__()
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self._printed_step = -1

    @property
    def is_disabled(self) -> bool:
        return super().is_disabled or not self.terminal

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._printed_step = trainer.global_step
        self.train_progress_bar.set_description("step")
        self.train_progress_bar.reset(total=convert_inf(trainer.estimated_stepping_batches))
        self.train_progress_bar.n = trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.refresh()

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # no per-epoch bar: the bar counts optimizer steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.terminal:
            self._print_line(trainer)
            return
        bar = self.train_progress_bar
        if bar is None or trainer.global_step == bar.n or not self._should_update(trainer.global_step, bar.total):
            return
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Without a terminal, a line of each validation's figures at the step it ran after (the step lines leave them
        out: carried over to later steps' lines, they read as those steps' own)."""
        super().on_validation_end(trainer, pl_module)
        shown = {name: value for name, value in self.figures(trainer).items() if name.startswith("val_")}
        if not self.terminal and not super().is_disabled and not trainer.sanity_checking and shown:
            print(f"validation at step {trainer.global_step}  " + "  ".join(f"{name} {_number(value)}" for name, value in shown.items()), flush=True)

    def _print_line(self, trainer: Trainer) -> None:
        step, total = trainer.global_step, convert_inf(trainer.estimated_stepping_batches)
        last = total is not None and step >= total
        if super().is_disabled or step == self._printed_step or not (last or step % max(trainer.log_every_n_steps, 1) == 0):
            return
        self._printed_step = step
        shown = "  ".join(f"{name} {_number(value)}" for name, value in self.figures(trainer).items() if not name.startswith("val_"))
        print(f"step {step}/{total if total is not None else '?'}  {shown}".rstrip(), flush=True)

    def figures(self, trainer: Trainer) -> dict[str, float]:
        """The figures of ``_SHORT`` the run has logged, as plain numbers under their short names."""
        logged = trainer.callback_metrics
        return {short: float(logged[name]) for name, short in _SHORT.items() if name in logged}

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        shown = {_SHORT.get(name, name.removeprefix("train/")): value for name, value in metrics.items()}
        return {**shown, **{name: _number(value) for name, value in self.figures(trainer).items() if name not in shown}}


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_third_party_noise() -> None:
    """Lightning's advertising tips, its hint to use ``srun`` on any machine where SLURM is installed, deprecation
    warnings raised inside libraries by their own calls, two warnings about GRPO's own design, the non-empty
    checkpoint folder the CLI has already ruled on, and the empty held-out list of a run without held-out data: none
    is about the user's run."""
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
    # An SFT run without data.val_data has no held-out batches on purpose (a data file without rows is refused by name).
    warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
