"""The ``lightning-rl`` command: ``run RECIPE.yaml [--dotted.key=value ...]``, and ``env`` / ``launch`` / ``plan``.

A recipe is a LightningCLI config: ``task`` picks the module and datamodule classes, ``model`` and
``data`` are their init arguments, ``trainer`` the Trainer's, plus ``output_dir``, ``seed``, ``logger``,
``checkpoint_every_n_steps`` and ``ckpt_path`` (``last`` resumes from OUTPUT_DIR/checkpoints).
Mistakes in a recipe end the command with one ``error:`` line naming the key or file, and exit code 2.
"""

from __future__ import annotations

import importlib
import inspect
import netrc
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from jsonargparse import ArgumentError
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from lightning_rl.callbacks import ExportHuggingFace, RequeueOnSignal, RunSummary
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
EXIT_USAGE = 2
EXIT_SIGTERM = 128 + 15  # the shell's code for a process ended by SIGTERM


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
    """Writes the resolved recipe to OUTPUT_DIR/recipe.yaml once the data has been checked (atomically)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        path = Path(self.config["output_dir"]) / "recipe.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.parser.save(self.config, str(tmp), skip_none=False, overwrite=True, multifile=False)
        os.replace(tmp, path)


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipe's top-level keys and the callbacks every run gets."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--task", type=Literal[tuple(TASKS)], required=True, help="what to train: " + ", ".join(TASKS))
        parser.add_argument("--output_dir", type=str, default="outputs/run", help="checkpoints, summary.json, hf/ and logs")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--checkpoint_every_n_steps", type=int, default=100)
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from, or 'last'")
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
        callbacks = list(config["trainer"].get("callbacks") or [])
        callbacks += [
            RunSummary(output_dir, task=config["task"]),
            ExportHuggingFace(output_dir),
            RequeueOnSignal(output_dir),
            ModelCheckpoint(
                dirpath=output_dir / "checkpoints",
                filename="{step}",
                every_n_train_steps=config["checkpoint_every_n_steps"],
                save_top_k=1,
                save_last=True,
            ),
        ]
        return super().instantiate_trainer(callbacks=callbacks, logger=build_logger(config["logger"], output_dir), **kwargs)


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


def resume_path(output_dir: Path, ckpt_path: str | None) -> str | None:
    """``last`` is the newest of ``checkpoints/last.ckpt`` and the ``hpc_ckpt_N.ckpt`` written on SLURM's requeue
    signal (``RequeueOnSignal``); Lightning itself would take ``last.ckpt`` even when the requeue checkpoint is newer."""
    if ckpt_path != "last":
        return ckpt_path
    candidates = [output_dir / "checkpoints" / "last.ckpt", *output_dir.glob("hpc_ckpt_*.ckpt")]
    found = [path for path in candidates if path.exists()]
    return str(max(found, key=lambda path: path.stat().st_mtime_ns)) if found else "last"


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
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=resume_path(Path(cli.config["output_dir"]), cli.config["ckpt_path"]))
    except ExpertParallelError as e:  # found once the strategy knows the world size, before any step
        raise RecipeError(f"{recipe}: trainer.strategy: {_one_line(e)}") from None
    except CheckpointMismatchError as e:  # found when the sharded model reads its weights, before any step
        raise RecipeError(f"{recipe}: model.model_name_or_path: {_one_line(e)}") from None
    except SIGTERMException:
        # Lightning stops cleanly on SIGTERM but exits 0; a stopped run must not look finished.
        print(f"stopped by SIGTERM after step {cli.trainer.global_step}; resume with --ckpt_path=last", file=sys.stderr)
        return EXIT_SIGTERM
    # Lightning leaves the process groups to the interpreter's exit, where gloo's worker threads can abort the
    # process (SIGABRT) while a peer is still writing the export. Every collective is done here.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
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
