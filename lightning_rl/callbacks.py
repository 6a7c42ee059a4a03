"""Callbacks every run gets: throughput and summary.json, the final HF export, signals, non-finite guard, loggers.

A module's ``training_step`` returns ``{"loss", "tokens", "flat_tokens"}`` (tokens forwarded, and what
flat packing would have forwarded), and ``reported_loss`` when the ``loss`` it backpropagates is not the
figure to report (SFT backpropagates a sum); a module whose optimizer step spans micro-batches keeps that step's loss
(over them and every rank) in ``step_loss``, which the summary's losses are then; a module may add figures to the
summary with ``summary_metrics()``.
A run that finishes ends with one closing line (``RunSummary``): where its summary and model are, its held-out score
and its wall time.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_rl.checkpoints import remove
from lightning_rl.errors import UserError
from lightning_rl.ops.grad_norm import total_grad_norm
from lightning_rl.stopping import StepAbandoned, may_abandon, signal_came


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak accelerator memory allocated by torch, or the process's peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process_max_rss"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # one name: a kill leaves at most this file, reused next time
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class RunSummary(Callback):
    """Tracks loss and throughput, shows tokens/s on the progress bar, writes OUTPUT_DIR/summary.json, and ends a
    finished run with its closing line."""

    def __init__(self, output_dir: str | Path, task: str, window: int = 10) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "summary.json"
        self.finished: dict[str, Any] | None = None  # the summary of a fit whose training finished, written once it ends
        self.task = task
        self.window = window
        self.losses: list[float] = []  # one per optimizer step (per micro-batch for a module without ``step_loss``)
        self.micro_batches = 0
        self._recorded_step: int | None = None  # the step whose loss ``losses`` ends with
        self.tokens = 0
        self.flat_tokens = 0
        self.train_seconds = 0.0
        self.earlier_wall_seconds = 0.0  # of the run's parts before a resume
        self._batch_start = 0.0
        self._fit_start = 0.0
        self._step_tokens, self._step_seconds, self._throughput_step = 0, 0.0, 0  # the step in the making
        self.extra: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        # In every checkpoint, so that the summary of a resumed run describes the whole run.
        return {
            "losses": list(self.losses),
            "micro_batches": self.micro_batches,
            "tokens": self.tokens,
            "flat_tokens": self.flat_tokens,
            "train_seconds": self.train_seconds,
            "wall_seconds": self._wall_seconds(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [float(loss) for loss in state["losses"]]
        self.micro_batches = int(state.get("micro_batches", len(self.losses)))
        self.tokens, self.flat_tokens = int(state["tokens"]), int(state["flat_tokens"])
        self.train_seconds = float(state["train_seconds"])
        self.earlier_wall_seconds = float(state["wall_seconds"])

    def _wall_seconds(self) -> float:
        return self.earlier_wall_seconds + (time.perf_counter() - self._fit_start if self._fit_start else 0.0)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self.finished = None  # an earlier fit of this trainer whose end failed (its teardown never came) says nothing
        self._step_tokens, self._step_seconds = 0, 0.0
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._throughput_step = trainer.global_step  # a resume's restored step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._batch_start
        self.train_seconds += seconds
        if not isinstance(outputs, dict):
            return
        self.micro_batches += 1
        if not hasattr(pl_module, "step_loss"):
            self.losses.append(float(outputs.get("reported_loss", outputs["loss"])))
        elif pl_module.step_loss is not None and trainer.global_step != self._recorded_step:
            # The step's loss over every micro-batch and rank (as train/loss), once the step is taken.
            self.losses.append(float(pl_module.step_loss))
            self._recorded_step = trainer.global_step
        tokens = int(outputs.get("tokens", 0))
        counts = [tokens, int(outputs.get("flat_tokens", tokens))]
        if trainer.world_size > 1:  # the run's counts, every rank's (each rank's batch ends here the same number of times)
            summed = trainer.strategy.reduce(torch.tensor(counts, dtype=torch.float32, device=pl_module.device), reduce_op="sum")
            counts = [int(value) for value in summed.tolist()]
        self.tokens += counts[0]
        self.flat_tokens += counts[1]
        # The step's throughput, over its every micro-batch (and rank), once the step is taken.
        self._step_tokens, self._step_seconds = self._step_tokens + counts[0], self._step_seconds + seconds
        if trainer.global_step != self._throughput_step:
            pl_module.log("train/tokens_per_s", self._step_tokens / max(self._step_seconds, 1e-9), prog_bar=True)
            self._step_tokens, self._step_seconds, self._throughput_step = 0, 0.0, trainer.global_step

    def _mean(self, values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def figures(self, trainer: Trainer) -> dict[str, Any]:
        memory, memory_kind = peak_memory_mb(trainer.strategy.root_device)
        n = min(self.window, max(len(self.losses) // 2, 1))
        return {
            "task": self.task,
            "steps": trainer.global_step,
            "micro_batches": self.micro_batches,
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            # Fixed names whatever the run's length (GRPO says reward_first_window_mean the same way); the window's
            # size, which a short run shrinks, is given beside them.
            "loss_first_window_mean": self._mean(self.losses[:n]),
            "loss_last_window_mean": self._mean(self.losses[-n:]),
            "loss_window": n,
            "tokens": self.tokens,
            "flat_tokens": self.flat_tokens,
            "tokens_per_s": self.tokens / self.train_seconds if self.train_seconds else None,
            "flat_tokens_per_s": self.flat_tokens / self.train_seconds if self.train_seconds else None,
            "peak_memory_mb": memory,
            "peak_memory_kind": memory_kind,
            "train_seconds": self.train_seconds,
            "wall_seconds": self._wall_seconds(),
            "world_size": trainer.world_size,
        }

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        module_figures = pl_module.summary_metrics() if hasattr(pl_module, "summary_metrics") else {}
        summary = {**self.figures(trainer), **module_figures, **self.extra}
        for key, value in summary.items():
            if isinstance(value, float) and not math.isfinite(value):
                summary[key] = None
        if trainer.is_global_zero:
            self.finished = summary

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning calls teardown after every callback's on_fit_end, and not when one of them raised: the export is
        # written by now, and a run whose export failed has not finished, so it leaves no summary.json.
        if self.finished is not None:
            write_json_atomic(self.path, self.finished)
            print(closing_line(self.finished, self.path, self.output_dir / "hf"), flush=True)
            self.finished = None


def closing_line(summary: dict[str, Any], summary_path: Path, hf: Path) -> str:
    """One line for the end of a finished run: steps, wall time, the held-out score when it was evaluated, and where
    summary.json and the exported model are."""
    parts = [f"done: {summary['steps']} steps in {_duration(summary['wall_seconds'])}"]
    if summary.get("heldout_exact_match") is not None:
        score = f"held-out exact match {summary['heldout_exact_match']:.1%} of {summary['heldout_examples']}"
        if summary.get("heldout_exact_match_before") is not None:
            score += f" (before training: {summary['heldout_exact_match_before']:.1%})"
        parts.append(score)
    parts.append(f"summary {summary_path}")
    if hf.is_dir():
        parts.append(f"model {hf}")
    return "; ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class ExportHuggingFace(Callback):
    """At the end of a completed fit, writes OUTPUT_DIR/hf through the module's ``export_hf`` (every rank takes
    part, so sharded weights can be gathered; the global-zero rank writes)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / "hf"

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if hasattr(pl_module, "export_hf"):
            pl_module.export_hf(self.path, write=trainer.is_global_zero)


class ScheduleOnResume(Callback):
    """A resume whose schedule spans another number of steps than the run that wrote the checkpoint (another
    ``trainer.max_steps`` or ``trainer.max_epochs``) says in one line how the learning-rate schedule changes, and
    follows the new schedule from its first step.

    Every checkpoint records the run's ``max_steps``, ``max_epochs`` and the schedule's length. On resume the schedule
    is rebuilt over the new length, while the optimizer comes back with the old schedule's learning rate for this
    step: without the correction here the first step would use the old value and the next ones the new schedule's.
    """

    def __init__(self) -> None:
        self.length: dict[str, Any] = {}  # this run's max_steps, max_epochs and schedule length, saved in every checkpoint
        self.recorded: dict[str, Any] | None = None  # the checkpoint's

    def state_dict(self) -> dict[str, Any]:
        return dict(self.length)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recorded = dict(state)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        self.length = {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs,
                       "schedule_steps": int(total) if math.isfinite(total) else None}
        recorded, self.recorded = self.recorded, None
        if not recorded:
            return
        if recorded.get("schedule_steps") == self.length["schedule_steps"]:  # a limit that does not bind changed, or none
            return
        # The limits that changed (a checkpoint of an earlier version records no max_epochs: taken as unchanged).
        changed = [key for key in ("max_steps", "max_epochs") if recorded.get(key, self.length[key]) != self.length[key]]
        step = trainer.global_step
        said = f"resume at step {step}: " + (", ".join(
            f"trainer.{key} is {self.length[key]}, the checkpoint's run had {recorded[key]}" for key in changed) or
            f"the run spans {self.length['schedule_steps']} steps, the checkpoint's spanned {recorded.get('schedule_steps')}")
        configs = trainer.lr_scheduler_configs  # one: the modules' configure_optimizers
        change = _follow_new_schedule(configs[0].scheduler, step) if configs else None
        if change is not None:
            old, new = change
            spans = f": the learning-rate schedule now spans {self.length['schedule_steps']} steps (it spanned {recorded.get('schedule_steps')})"
            if old == new and not _spans_the_run(configs[0].scheduler):
                said += f": the learning rate at this step stays {old:.3g} (its schedule does not depend on the run's length)"
            elif old == new:  # at the end of the warmup, say, both schedules give the peak rate
                said += f"{spans}; the learning rate at this step stays {old:.3g}, the next ones follow the new span"
            else:
                said += f"{spans}, so the learning rate at this step is {new:.3g}, not {old:.3g}"
        if trainer.is_global_zero:
            print(said, file=sys.stderr, flush=True)


def _spans_the_run(scheduler: Any) -> bool:
    """Whether a transformers schedule (a LambdaLR of partials) is built over the run's length (``num_training_steps``)."""
    return any("num_training_steps" in (getattr(rule, "keywords", None) or {}) for rule in getattr(scheduler, "lr_lambdas", ()))


def _follow_new_schedule(scheduler: Any, step: int) -> tuple[float, float] | None:
    """Set the optimizer's learning rates to what the (rebuilt) schedule gives at ``step``; (old, new) of the first
    group, or None for a scheduler that is not a function of the step."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return None
    groups = scheduler.optimizer.param_groups
    old = float(groups[0]["lr"])
    rates = [base * rule(step) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, rate in zip(groups, rates, strict=True):
        group["lr"] = rate
    return old, float(rates[0])


class ValidationOnResume(Callback):
    """A checkpoint written at the end of a step whose validation had not run yet (a periodic save, a stop signal's)
    resumes with that validation, as the uninterrupted run went on. Lightning resumes such a checkpoint past it, so a
    run stopped there logged no ``val/`` row for the step.

    The checkpoint's loop counters are written as Lightning's own would be in the first validation batch of that
    step: the training batch completed, the validation started and nothing of it done. A resume then runs the whole
    validation before the next training batch, at the same logged step."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        loop = trainer.fit_loop.epoch_loop
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        train, val = fit.get("epoch_loop.batch_progress"), fit.get("epoch_loop.val_loop.batch_progress")
        if not trainer.training or train is None or val is None:
            return
        at_batch_end = train["total"]["processed"] == train["total"]["completed"] + 1  # in on_train_batch_end
        if not at_batch_end or loop._should_accumulate() or not _validates_after_this_batch(trainer):
            return
        for counts in (train["total"], train["current"]):
            counts["completed"] = counts["processed"]
        val["total"] = {**val["total"], "ready": val["total"]["completed"] + 1, "started": val["total"]["completed"] + 1}
        val["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
        val["is_last_batch"] = False


class LoggerAfterSetup(Callback):
    """Attaches the run's logger once its model and data are set up: a run that fails before leaves no logger
    folder behind. It logs ``recipe``, the run's resolved recipe by dotted key, as the run's hyperparameters (the
    loss, sampling, rewards, data and trainer keys too: W&B's config, the CSV logger's hparams.yaml) as training
    starts, in place of the module's and datamodule's own, which Lightning would log after fit start: each setting
    once, under its recipe key (``model.learning_rate``, not ``learning_rate`` too)."""

    def __init__(self, logger: Logger, recipe: dict[str, Any] | None = None) -> None:
        self.logger, self.recipe = logger, recipe or {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.loggers = [*trainer.loggers, self.logger]
        if self.recipe:
            for owner in (pl_module, trainer.datamodule):
                if owner is not None:
                    owner._log_hyperparams = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Not at fit start: nothing may reach the logger's folder before --overwrite has removed the earlier run's.
        if self.recipe and trainer.is_global_zero:
            self.logger.log_hyperparams(self.recipe)


class _RecordingSignalConnector(_SignalConnector):
    """Lightning's signal connector with handlers that only record the signal (``RequeueOnSignal``).

    Lightning's own SIGTERM handler broadcasts a tensor from inside the handler and marks the trainer as stopping
    on that rank alone. ``received_sigterm`` stays False here: the loops must not stop one rank by itself.
    """

    def __init__(self, trainer: Trainer, owner: RequeueOnSignal) -> None:
        super().__init__(trainer)
        self.owner = owner

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self.owner.install()
        self._original_handlers = dict(self.owner.previous_handlers)  # what `teardown` puts back

    def teardown(self) -> None:
        # Lightning calls this before ``on_fit_end``: the handlers keep recording through the final export, which a
        # signal must not cut on one rank while another gathers; ``RequeueOnSignal.restore`` puts them back.
        self._original_handlers = {}


class PeriodicAndFinalCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` every ``every_n_train_steps`` steps, and at the end of training at its last step, whatever
    that is. Lightning's saves ``last`` at the end only when no ``last`` was saved yet: a run of 25 steps every 10
    ended with last.ckpt at step 20, and resuming the finished run trained its last 5 steps again."""

    @property
    def state_key(self) -> str:
        """One per run, whatever its period: Lightning's key holds ``every_n_train_steps``, so a resume with another
        ``checkpoint_every_n_steps`` forgot the run's checkpoints (last.ckpt stayed at the old step, last-v1.ckpt
        beside it, the periodic ones never pruned)."""
        return type(self).__qualname__

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A run folder moved or renamed since its checkpoint: the checkpoints it names are read in the folder where
        they are now. Lightning forgets them instead, and then neither prunes the old periodic ones (keep_checkpoints)
        nor replaces last.ckpt (it writes last-v1.ckpt beside it)."""
        saved = state_dict.get("dirpath")
        if saved and self.dirpath and Path(saved) != Path(self.dirpath):
            here = lambda path: str(Path(self.dirpath) / Path(path).name) if path else path  # noqa: E731
            state_dict = {
                **state_dict, "dirpath": self.dirpath,
                "best_k_models": {here(path): score for path, score in state_dict.get("best_k_models", {}).items()},
                **{key: here(state_dict[key]) for key in ("kth_best_model_path", "last_model_path", "best_model_path") if key in state_dict},
            }  # fmt: skip
        super().load_state_dict(state_dict)
        self._keep_within_limit()

    def _keep_within_limit(self) -> None:
        """A resume with a lower ``keep_checkpoints`` than the run kept: the newest of its periodic checkpoints are
        kept, the rest removed once the next periodic or last checkpoint is written (`_save_checkpoint`; never the one
        resumed from before that). Lightning restores them all, and then either failed at its next save (a
        ``KeyError`` deep in ``ModelCheckpoint``, where the run had kept fewer than its old limit) or never pruned
        again (it prunes only at exactly the limit)."""
        k = self.save_top_k
        if k < 0 or len(self.best_k_models) < k or (len(self.best_k_models) == k and self.kth_best_model_path in self.best_k_models):
            return
        ranked = sorted(self.best_k_models, key=lambda path: float(self.best_k_models[path]), reverse=self.mode == "max")
        self.best_k_models = {path: self.best_k_models[path] for path in ranked[:k]}
        if k:
            self.kth_best_model_path = ranked[k - 1]
            self.kth_value = self.best_k_models[self.kth_best_model_path]

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Each save, once written, removes the run's periodic checkpoints of earlier steps beyond the
        ``keep_checkpoints`` kept, as the folder holds them: those of a lowered limit, and those a kill left that the
        resumed run's record does not name (a kill between a periodic save and the removal of the one it replaced;
        they stayed for good). Never one of a later step (another run's, under a Trainer of one's own) nor the one
        resumed from (as Lightning keeps it)."""
        super()._save_checkpoint(trainer, filepath)
        if self.save_top_k < 0 or self.dirpath is None or not Path(self.dirpath).is_dir() or "{step}" not in (self.filename or ""):
            return
        periodic = re.compile(re.escape(self.filename or "").replace(re.escape("{step}"), r"step=(\d+)") + r"(?:-v\d+)?\.ckpt")
        kept = {Path(path).name for path in self.best_k_models} | {Path(filepath).name}
        resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
        for path in sorted(Path(self.dirpath).iterdir()):
            name = periodic.fullmatch(path.name)
            if name and int(name[1]) < trainer.global_step and path.name not in kept and path.resolve() != resumed:
                self._remove_checkpoint(trainer, str(path))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The last step's checkpoint is written at its end (after its validation, if one is due), as a periodic one
        is: written at ``on_train_end``, it held the loops of an epoch counted as finished, and a resume that went
        past ``max_steps`` (more steps, or ``max_epochs``) started the next epoch where the old one had stopped."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._at_last_step(trainer) and trainer.global_step != self._last_global_step_saved and not _validates_after_this_batch(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._at_last_step(trainer) and not trainer.sanity_checking:  # again if saved at the step's end: its validation is done
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The last epoch's checkpoint likewise, before Lightning counts the epoch as done (its validation has run)."""
        super().on_train_epoch_end(trainer, pl_module)
        if trainer.state.fn == TrainerFn.FITTING and trainer.global_step != self._last_global_step_saved and _last_epoch(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @staticmethod
    def _at_last_step(trainer: Trainer) -> bool:
        return trainer.state.fn == TrainerFn.FITTING and 0 < trainer.max_steps <= trainer.global_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self._last_global_step_saved:  # the end of max_epochs; not after a stop (an exception) or a NaN
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero and self.dirpath is not None:
            # A signal's checkpoint (RequeueOnSignal) of an earlier step is superseded by the final one, which
            # --ckpt_path=last takes: it went on holding a whole model and its optimizer state on the disk.
            for path in Path(self.dirpath).parent.glob("hpc_ckpt_*.ckpt"):
                step = re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", path.name)
                if step is not None and int(step[1]) < trainer.global_step:
                    remove(path)


def _validates_after_this_batch(trainer: Trainer) -> bool:
    """Whether Lightning validates once the training batch now ending is done (its epoch loop's own test), with
    batches to validate on: a validation without any (no val_data) is skipped, and with it ``on_validation_end``,
    where the checkpoint put off to after it would have been written."""
    loop = trainer.fit_loop.epoch_loop
    if not loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
        return False
    loop.val_loop.setup_data()  # what that validation reads first (its loaders, once), read now
    return not loop.val_loop.skip


def _last_epoch(trainer: Trainer) -> bool:
    return trainer.max_epochs is not None and trainer.max_epochs >= 0 and trainer.current_epoch + 1 >= trainer.max_epochs


def ends_training(trainer: Trainer) -> bool:
    """Whether the step just finished is the run's last: ``max_steps`` reached, or the last batch of ``max_epochs``."""
    return 0 < trainer.max_steps <= trainer.global_step or (_last_epoch(trainer) and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _log_finished_step(trainer: Trainer) -> None:
    """Hand the loggers the figures of the step just finished, as Lightning does right after ``on_train_batch_end``
    (a stop raised there skips it: a stopped run's log would end a step before its checkpoint)."""
    connector = trainer._logger_connector
    connector.on_batch_end()
    # Only a step Lightning's interval logs (its own test, before it counts the step): with log_every_n_steps > 1 the
    # stopped run logged a step the uninterrupted one does not.
    if (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % trainer.log_every_n_steps == 0:
        connector.log_metrics(connector.metrics["log"])


class RequeueOnSignal(Callback):
    """SIGTERM and the requeue signal (SIGUSR1) handled at an optimizer-step boundary, on every rank at once, under
    every strategy.

    Lightning's handlers act inside the signal handler, wherever each rank happens to be in its step: the SIGTERM
    one broadcasts a tensor, the SLURM one saves a checkpoint, which under a sharded strategy is a collective. Two
    ranks signalled mid-step (one in backward, the other in a reduce-scatter) then wait on each other forever. Here
    the handlers only record the signal, and replace Lightning's for the whole fit. After each optimizer step the
    ranks agree on it (one all-reduce), save ``OUTPUT_DIR/hpc_ckpt_STEP.ckpt`` together (staged and renamed whole;
    it replaces older ones) and stop with ``SIGTERMException``, which ``lightning-rl run`` ends with exit code 143.
    A signal that came before the first step stops the run at ``on_train_start``, with nothing new to save. One that
    comes during the last step or after its boundary lets the final checkpoint and ``hf/`` be written whole (both
    staged): the run ends finished, exit 0, and says so in one line (a checkpoint of the last step would leave nothing
    to resume, and no export).

    Under SLURM with auto-requeue (the default there) the requeue signal comes ahead of the time limit: rank 0 also
    runs ``scontrol requeue``, and the ranks wait for the SIGTERM with which SLURM then stops the job (the requeued
    job's ``--ckpt_path=last`` takes this checkpoint). Elsewhere the requeue signal stops the run like SIGTERM.

    A step that waits on something that does not return (a reward, a tool, async GRPO's rollout producer) would hold
    the stop back until its timeout. So a signal inside a step that starts at an optimizer-step boundary gives the step
    up (``stopping``: its wait raises ``StepAbandoned``, on every rank at once, before the step's first collective),
    and the state of the last complete step, which the abandoned one had not yet changed, is saved as above, with the
    loops' counters of a run between two steps, so that the resume trains the abandoned step once.
    """

    def __init__(self, output_dir: str | Path, sigterm_wait_s: float = 300.0) -> None:
        self.output_dir = Path(output_dir)
        self.sigterm_wait_s = sigterm_wait_s
        self.requeue_signal = signal.SIGUSR1
        self.received: set[int] = set()
        self.previous_handlers: dict[int, Any] = {}
        self.stopped_by: str | None = None  # the signal's name, once the run stopped on it
        self.checkpoint: Path | None = None
        self._slurm_requeue = False
        self._last_step = -1
        self._at_boundary = True  # the last batch ended an optimizer step
        self._may_abandon = False  # inside a step that a stop signal may abandon

    def install(self) -> None:
        """Record SIGTERM and the requeue signal from now on; ``restore`` puts the earlier handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (Lightning skips them there too)
        for signum in (signal.SIGTERM, self.requeue_signal):
            if signum not in self.previous_handlers:
                self.previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._record)

    def restore(self) -> None:
        may_abandon(False)  # the stop request stays: async GRPO's rollout producer, closed after this, gives up on it
        for signum, handler in self.previous_handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        self.previous_handlers = {}

    def _record(self, signum: int, _frame: Any) -> None:
        self.received.add(signum)
        signal_came()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # The connector's, as Lightning's own signal handling reads it: a one-device strategy holds none of its own, and
        # a one-rank SLURM job was not requeued on the signal (it ended FAILED at its time limit).
        environment = getattr(trainer.strategy, "cluster_environment", None) or trainer._accelerator_connector.cluster_environment
        self._slurm_requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
            self.requeue_signal = environment.requeue_signal
        signal_came(bool(self.received))  # not a request left by an earlier fit in this process
        if self._slurm_requeue:
            print(f"SLURM auto-requeueing enabled: {signal.Signals(self.requeue_signal).name} requeues the job at the next step boundary", flush=True)
        self.install()
        # Lightning installs its handlers through this connector just before training starts (a private attribute,
        # and the only place to keep its collective-running SIGTERM handler out).
        trainer._signal_connector = _RecordingSignalConnector(trainer, self)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step
        self._agree_and_stop(trainer, save=False)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._may_abandon = self._at_boundary
        may_abandon(self._may_abandon)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._may_abandon = False
        may_abandon(False)
        self._at_boundary = trainer.global_step != self._last_step
        if not self._at_boundary:
            return  # mid-accumulation: no optimizer step yet, nothing consistent to save
        self._last_step = trainer.global_step
        self._agree_and_stop(trainer, save=True)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, StepAbandoned) and self._may_abandon:
            self._save_abandoned(trainer, exception)
        self._may_abandon = False
        self.restore()

    def _save_abandoned(self, trainer: Trainer, abandoned: StepAbandoned) -> None:
        """Save the last complete step for a step given up mid-way; ``StepAbandoned`` then ends the process (143)."""
        # Lightning counts the abandoned batch as started but not processed; a checkpoint with those counters would
        # resume past the batch's data position. Counted as not drawn at all, the run is between two steps.
        progress = trainer.fit_loop.epoch_loop.batch_progress
        for tracker in (progress.total, progress.current):
            tracker.ready = tracker.started = tracker.processed = tracker.completed
        terminate, _ = self._agreed_signals(trainer)  # every rank gave the step up at the same point: all are here
        step = trainer.global_step
        self._save(trainer, step)
        if not terminate and self._slurm_requeue and self._requeue(trainer):
            self._wait_for_sigterm()
        self.stopped_by = signal.Signals(signal.SIGTERM if terminate else self.requeue_signal).name
        if trainer.is_global_zero:
            print(f"stopped by {self.stopped_by} after step {step} (step {step + 1} given up: {abandoned.why}); resume "
                  "with --ckpt_path=last", file=sys.stderr, flush=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pass  # the handlers keep recording until the run is over (`restore`, called by whoever installed them): a
        # signal after the closing line, which other callbacks' teardown prints, must not kill a finished run

    def _agreed_signals(self, trainer: Trainer) -> tuple[bool, bool]:
        """Whether any rank received SIGTERM, and the requeue signal (one all-reduce)."""
        local = [signal.SIGTERM in self.received, self.requeue_signal in self.received]
        flags = torch.tensor(local, dtype=torch.float32, device=trainer.strategy.root_device)
        terminate, requeue = (bool(flag) for flag in trainer.strategy.reduce(flags, reduce_op="sum").tolist())
        return terminate, requeue

    def _agree_and_stop(self, trainer: Trainer, save: bool) -> None:
        terminate, requeue = self._agreed_signals(trainer)
        if not (terminate or requeue):
            return
        if save and ends_training(trainer):  # the run finishes instead: its final checkpoint and hf/, staged (`run`)
            return
        if save:
            self._save(trainer, trainer.global_step)
        if not terminate and self._slurm_requeue:
            if not self._requeue(trainer):
                self.received.discard(self.requeue_signal)
                signal_came(bool(self.received))
                return  # no scheduler took the job back: training goes on
            self._wait_for_sigterm()
        self.stopped_by = signal.Signals(signal.SIGTERM if terminate else self.requeue_signal).name
        if save:
            _log_finished_step(trainer)
        raise SIGTERMException

    def _save(self, trainer: Trainer, step: int) -> None:
        self.checkpoint = self.output_dir / f"hpc_ckpt_{step}.ckpt"
        # The whole state, said outright (Lightning logs a line when it has to assume it); a collective under sharded
        # strategies: every rank is here.
        trainer.save_checkpoint(self.checkpoint, weights_only=False)
        if trainer.is_global_zero:
            for older in self.output_dir.glob("hpc_ckpt_*.ckpt"):
                if older != self.checkpoint:
                    remove(older)

    def _wait_for_sigterm(self) -> None:
        # Train no further on a job that is being requeued: wait for SLURM's SIGTERM, which ends the run unfinished.
        deadline = time.monotonic() + self.sigterm_wait_s
        while signal.SIGTERM not in self.received and time.monotonic() < deadline:
            time.sleep(0.1)

    def _requeue(self, trainer: Trainer) -> bool:
        """Rank 0 asks SLURM to requeue the job; every rank learns whether it did."""
        requeued = False
        if trainer.is_global_zero:
            job = os.environ.get("SLURM_JOB_ID", "")
            if os.environ.get("SLURM_ARRAY_JOB_ID"):
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            saved = f"checkpoint {self.checkpoint}" if self.checkpoint else "before the first step, nothing new to save"
            print(f"requeue signal: {saved} at step {trainer.global_step}; requeueing job {job}", flush=True)
            try:
                result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                error = (result.stderr.strip() or f"exit code {result.returncode}") if result.returncode else ""
            except OSError as err:  # no scontrol on this node: say so, and let the other ranks go on too
                error = str(err)
            # The requeue's own SIGTERM can reach scontrol too (it runs in the job): that is a success.
            requeued = not error or signal.SIGTERM in self.received
            if not requeued:
                print(f"scontrol requeue {job} failed: {error}; training goes on", flush=True)
        return bool(trainer.strategy.broadcast(requeued, src=0))


class NonFiniteError(UserError, RuntimeError):
    """A loss or gradient norm that is not finite: the run stopped before that optimizer step, saving nothing for it.
    Every rank raises it at the same step; the run ends with exit code 1 (the recipe ran, the training diverged)."""

    exit_code = 1
    on_every_rank = True


class StopOnNonFinite(Callback):
    """Never steps, and so never checkpoints, on a non-finite loss or gradient norm.

    Each rank keeps the loss of every backward; before each optimizer step the ranks agree on them and on the
    gradient norm (the same figure on every rank) with one all-reduce, and if one is not finite all raise
    ``NonFiniteError`` before the optimizer steps. Checkpoints are written after a step, so the newest stays the
    last good one (``ModelCheckpoint(save_top_k=1)`` would otherwise have replaced it with the broken one).
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(-1))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        losses = torch.cat(self._losses) if self._losses else torch.zeros(0)
        self._losses = []
        bad = losses[~torch.isfinite(losses)].cpu()
        norm = float(total_grad_norm(pl_module.parameters()))
        local = [float(bad.numel() > 0), float(not math.isfinite(norm))]
        flags = trainer.strategy.reduce(torch.tensor(local, device=trainer.strategy.root_device), reduce_op="sum")
        bad_loss, bad_norm = (bool(flag) for flag in flags.tolist())
        if not (bad_loss or bad_norm):
            return
        if bad_loss:
            what = f"loss is {float(bad[0])}" if bad.numel() else "loss is not finite on another rank"
        else:
            what = f"gradient norm is {norm}"
        raise NonFiniteError(f"step {trainer.global_step + 1}: {what}; stopped before the optimizer step, no checkpoint written for it")
