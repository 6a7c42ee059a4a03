"""The ``lightning-rl`` command: ``run RECIPE.yaml [--dotted.key=value ...]``, and ``env`` / ``launch`` / ``plan``.

A recipe is a LightningCLI config: ``task`` picks the module and datamodule classes, ``model`` and
``data`` are their init arguments, ``trainer`` the Trainer's, plus ``output_dir``, ``seed``, ``logger``,
``checkpoint_every_n_steps``, ``ckpt_path`` (``last`` resumes from the newest complete checkpoint of the run) and
``overwrite``. Mistakes in a recipe end the command with one ``error:`` line naming the key or file, and exit code 2.

The run folder belongs to one run: a folder that already holds outputs is refused unless the run resumes it
(``--ckpt_path``) or replaces it (``--overwrite``), a lock keeps a concurrent run out, and nothing is written into it
before the model and data are set up.
"""

from __future__ import annotations

import fcntl
import importlib
import inspect
import netrc
import os
import re
import shutil
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from jsonargparse import ActionYesNo, ArgumentError
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from lightning_rl.callbacks import (
    ExportHuggingFace, LoggerAfterSetup, NonFiniteError, RequeueOnSignal, RunSummary, StopOnNonFinite,
)
from lightning_rl.checkpoints import IncompleteCheckpointError, StagedCheckpointIO, checkpoint_step, clean_staging, newest_complete
from lightning_rl.data.sft import DataError
from lightning_rl.models.sharded_loading import CheckpointMismatchError
from lightning_rl.strategies.expert_parallel import ExpertParallelError
from lightning_rl.strategies import check_strategy_request

TASKS = {
    "sft": ("lightning_rl.modules.sft:SFTModule", "lightning_rl.data.sft:SFTDataModule"),
    "grpo": ("lightning_rl.modules.grpo:GRPOModule", "lightning_rl.data.prompts:PromptDataModule"),
}
SUBCOMMANDS = {
    "env": "lightning_rl.env_report",
    "launch": "lightning_rl.launch.slurm",
    "plan": "lightning_rl.launch.plan",
}
USAGE = "usage: lightning-rl {run RECIPE.yaml [--key=value ...] | env | launch ... | plan ...}"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SIGTERM = 128 + 15  # the shell's code for a process ended by SIGTERM
LOCK_FILE = ".lock"
# What a run writes into OUTPUT_DIR, removed by --overwrite (anything else there is left alone).
RUN_OUTPUTS = ("checkpoints", "hf", "summary.json", "recipe.yaml", "csv", "wandb", "hpc_ckpt_*.ckpt*")


class RecipeError(ValueError):
    """A recipe that cannot be run as written."""


@dataclass
class LoggerSettings:
    """The ``logger:`` block. ``wandb`` logs offline when no credentials are configured."""

    kind: Literal["csv", "wandb", "none"] = "csv"
    project: str = "lightning-rl"
    name: str | None = None
    offline: bool | None = None


def _import(target: str) -> Any:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def task_classes(task: str) -> tuple[type[LightningModule], type[LightningDataModule]]:
    if task not in TASKS:
        raise RecipeError(f"task: unknown task {task!r} (expected one of {', '.join(TASKS)})")
    try:
        return _import(TASKS[task][0]), _import(TASKS[task][1])
    except ImportError as e:
        raise RecipeError(f"task: {task!r} is not available in this install ({e})") from None


def read_task(recipe: Path, overrides: list[str]) -> str:
    """The recipe's ``task`` (a ``--task=...`` override wins), read before the full parse picks classes."""
    for arg in overrides:
        if arg.startswith("--task="):
            return arg.split("=", 1)[1]
    if not recipe.is_file():
        raise RecipeError(f"{recipe}: no such recipe file")
    try:
        config = yaml.safe_load(recipe.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{recipe}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict) or "task" not in config:
        raise RecipeError(f"{recipe}: missing key 'task' (one of {', '.join(TASKS)})")
    return str(config["task"])


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai") is not None  # NETRC as wandb reads it
    except (OSError, netrc.NetrcParseError):
        return False


def build_logger(settings: LoggerSettings, output_dir: Path) -> Logger | bool:
    if settings.kind == "none":
        return False
    if settings.kind == "csv":
        return CSVLogger(save_dir=output_dir, name="csv")
    offline = settings.offline if settings.offline is not None else (os.environ.get("WANDB_MODE") == "offline" or not has_wandb_credentials())
    if offline:
        print(f"W&B: logging offline to {output_dir}/wandb; upload later with `wandb sync {output_dir}/wandb/offline-run-*`", file=sys.stderr)
    return WandbLogger(project=settings.project, name=settings.name, save_dir=str(output_dir), offline=offline)


class SaveRecipe(SaveConfigCallback):
    """The run's first writes, once its model and data are set up: with ``--overwrite`` the previous run's outputs
    go, then the resolved recipe is written to OUTPUT_DIR/recipe.yaml (atomically)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pass  # where SaveConfigCallback writes: too early, the model is not set up yet

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        output_dir = Path(self.config["output_dir"])
        if self.config["overwrite"] and self.config["ckpt_path"] is None:
            remove_run_outputs(output_dir)
        path = output_dir / "recipe.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        config = self.config.clone()
        config.overwrite = False  # rerunning the saved recipe must not replace this run
        self.parser.save(config, str(tmp), skip_none=False, overwrite=True, multifile=False)
        os.replace(tmp, path)


def remove_run_outputs(output_dir: Path) -> None:
    for pattern in RUN_OUTPUTS:
        for path in output_dir.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipe's top-level keys and the callbacks every run gets."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--task", type=Literal[tuple(TASKS)], required=True, help="what to train: " + ", ".join(TASKS))
        parser.add_argument("--output_dir", type=str, default="outputs/run", help="checkpoints, summary.json, hf/ and logs")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--checkpoint_every_n_steps", type=int, default=100)
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from, or 'last'")
        parser.add_argument("--overwrite", action=ActionYesNo, default=False, help="replace the outputs of an earlier run in output_dir")
        parser.add_class_arguments(LoggerSettings, "logger")
        parser.link_arguments("seed", "seed_everything")
        parser.link_arguments("output_dir", "trainer.default_root_dir")
        if "seed" in inspect.signature(self.datamodule_class).parameters:
            parser.link_arguments("seed", "data.seed")
        if "tokenizer" in inspect.signature(self.datamodule_class).parameters and "model_name_or_path" in inspect.signature(self.model_class).parameters:
            parser.link_arguments("model.model_name_or_path", "data.tokenizer")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init
        strategy, accelerator = config["trainer"].get("strategy"), config["trainer"].get("accelerator")
        if isinstance(strategy, str):  # refuse what this machine cannot run before Lightning starts on it
            check_strategy_request(strategy, accelerator if isinstance(accelerator, str) else None)
        output_dir = Path(config["output_dir"])
        self.requeue = RequeueOnSignal(output_dir)
        logger = build_logger(config["logger"], output_dir)
        callbacks = list(config["trainer"].get("callbacks") or [])
        callbacks += [
            RunSummary(output_dir, task=config["task"]),
            ExportHuggingFace(output_dir),
            self.requeue,
            StopOnNonFinite(),
            *([LoggerAfterSetup(logger)] if logger else []),
            ModelCheckpoint(
                dirpath=output_dir / "checkpoints",
                filename="{step}",
                every_n_train_steps=config["checkpoint_every_n_steps"],
                save_top_k=1,
                save_last=True,
            ),
        ]
        trainer = super().instantiate_trainer(callbacks=callbacks, logger=False, **kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; XLA's own is left alone
            trainer.strategy.checkpoint_io = StagedCheckpointIO()
        return trainer


_UNKNOWN_KEY = [
    (re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'"), lambda m: f"{m[1]}.{m[2]}"),
    (re.compile(r"Option '([\w.]+)' is not accepted"), lambda m: m[1]),
    (re.compile(r"unrecognized arguments: --([\w.]+)"), lambda m: m[1]),
]


def _one_line(error: BaseException) -> str:
    """jsonargparse spreads a problem over several lines; say it on one, unknown keys by name."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    parent = re.search(r'Parser key "([\w.]+)"', text)
    for pattern, key in _UNKNOWN_KEY:
        if match := pattern.search(text):
            name = key(match)
            if parent and not name.startswith(parent[1]):  # an init argument of a class given by class_path
                name = f"{parent[1]}{'.init_args.' if 'class_path' in text else '.'}{name}"
            return f"unknown key '{name}'"
    return text if len(text) <= 400 else text[:400] + " ..."


def is_first_process() -> bool:
    """Whether this process is rank 0 of the job, read from what launchers set before any process group exists
    (Lightning's own launcher, torchrun, SLURM)."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "SLURM_PROCID", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK"))


class RunFolderLock:
    """OUTPUT_DIR/.lock, held with ``flock`` by a run's first process and naming its pid: a second run into the same
    folder is refused while the first lives. The kernel drops the lock of a process that dies, so a lock file left
    by a killed run is simply taken over. Released (and the file removed) when the run ends."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.path = output_dir / LOCK_FILE
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> None:
        self._created_dir = not self.output_dir.exists()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise RecipeError(f"output_dir: {self.output_dir} is in use by another run ({holder}); let it finish or choose another output_dir") from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file as we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still holding it, so no one locks a file that is going away
        os.close(self._fd)
        self._fd = None
        if self._created_dir and not any(self.output_dir.iterdir()):
            self.output_dir.rmdir()  # a run that failed before writing anything leaves no folder either


def check_run_folder(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    """A folder that holds an earlier run's outputs is only reused to resume it or, explicitly, to replace it."""
    if resuming or overwrite or not output_dir.is_dir():
        return
    held = sorted(path.name for path in output_dir.iterdir() if path.name != LOCK_FILE)
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise RecipeError(f"output_dir: {output_dir} already holds a run ({shown}); resume it with --ckpt_path=last, or replace it with --overwrite")


def resume_path(output_dir: Path, ckpt_path: str | None, first: bool = True) -> str | None:
    """The checkpoint to resume from, verified complete (``lightning_rl/checkpoints.py``).

    ``last`` is the newest complete checkpoint of the run, whatever its name, and one line says which it is, with
    what was passed over (incomplete checkpoints) or cleaned up (what a killed write left). A checkpoint named
    outright must be complete. Only the ``first`` process, which holds the run folder's lock, cleans up and speaks.
    """
    if ckpt_path is None:
        return None
    cleaned = clean_staging(output_dir) if first else []
    if ckpt_path != "last":
        path = Path(ckpt_path)
        if not path.exists():
            raise RecipeError(f"ckpt_path: no such checkpoint: {path}")
        try:
            checkpoint_step(path)
        except IncompleteCheckpointError as e:
            raise RecipeError(f"ckpt_path: {path} is incomplete ({e}); --ckpt_path=last takes the newest complete one") from None
        return ckpt_path
    found, passed_over = newest_complete(output_dir)
    notes = [f"passed over {path.relative_to(output_dir)}: incomplete, {reason}" for path, reason in passed_over] + cleaned
    said = "".join(f"; {note}" for note in notes)
    if first and found is None:
        print(f"resume: no complete checkpoint in {output_dir}, starting from step 0{said}", file=sys.stderr)
    elif first:
        print(f"resume: step {found.step} from {found.path.relative_to(output_dir)}, the newest complete checkpoint{said}", file=sys.stderr)
    return str(found.path) if found else None


def _destroy_process_groups() -> None:
    # Lightning leaves the process groups to the interpreter's exit, where gloo's worker threads can abort the
    # process (SIGABRT) while a peer is still writing the export. Called once every collective is done.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run(recipe: str, overrides: list[str]) -> int:
    task = read_task(Path(recipe), overrides)
    model_class, datamodule_class = task_classes(task)
    try:
        with warnings.catch_warnings():
            # The recipe goes in as `args` on purpose; LightningCLI warns when sys.argv is also set.
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
            cli = RecipeCLI(
                model_class,
                datamodule_class,
                run=False,
                args=["--config", recipe, *overrides],
                save_config_callback=SaveRecipe,
                parser_kwargs={"exit_on_error": False, "prog": "lightning-rl run"},
                auto_configure_optimizers=False,
                # Packed rows are dealt to ranks by the datamodule's own sampler.
                trainer_defaults={"use_distributed_sampler": False},
            )
    except ArgumentError as e:
        raise RecipeError(f"{recipe}: {_one_line(e)}") from None
    except (ValueError, TypeError, OSError, MisconfigurationException) as e:
        if isinstance(e, DataError):
            raise
        raise RecipeError(f"{recipe}: {_one_line(e)}") from None
    output_dir, ckpt_path = Path(cli.config["output_dir"]), cli.config["ckpt_path"]
    first = is_first_process()
    lock = RunFolderLock(output_dir) if first else None
    cli.requeue.install()  # from here on a SIGTERM is recorded, and acted on at a step boundary
    try:
        if lock is not None:
            lock.acquire()
        check_run_folder(output_dir, resuming=ckpt_path is not None, overwrite=cli.config["overwrite"])
        return _fit(cli, recipe, resume_path(output_dir, ckpt_path, first))
    finally:
        cli.requeue.restore()
        if lock is not None:
            lock.release()


def _fit(cli: RecipeCLI, recipe: str, ckpt_path: str | None) -> int:
    trainer = cli.trainer
    try:
        trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    except ExpertParallelError as e:  # found once the strategy knows the world size, before any step
        raise RecipeError(f"{recipe}: trainer.strategy: {_one_line(e)}") from None
    except CheckpointMismatchError as e:  # found when the sharded model reads its weights, before any step
        raise RecipeError(f"{recipe}: model.model_name_or_path: {_one_line(e)}") from None
    except SIGTERMException:
        # Every rank stopped at the same step boundary (RequeueOnSignal); a stopped run must not look finished.
        if trainer.is_global_zero:
            print(f"stopped by {cli.requeue.stopped_by or 'SIGTERM'} after step {trainer.global_step}; resume with --ckpt_path=last", file=sys.stderr)
        _destroy_process_groups()
        return EXIT_SIGTERM
    except NonFiniteError as e:  # every rank stopped before the same optimizer step (StopOnNonFinite)
        if trainer.is_global_zero:
            print(f"error: {e}", file=sys.stderr)
        _destroy_process_groups()
        return EXIT_FAILED
    _destroy_process_groups()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command in SUBCOMMANDS:
        try:
            module = importlib.import_module(SUBCOMMANDS[command])
        except ImportError as e:
            print(f"error: `lightning-rl {command}` is not available in this install ({e})", file=sys.stderr)
            return EXIT_USAGE
        return int(module.main(rest) or 0)
    if command != "run":
        print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    if not rest or rest[0].startswith("-"):
        print(f"error: `run` needs a recipe file\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run(rest[0], rest[1:])
    except (RecipeError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
