"""The one recipe reader: ``lightning-rl run`` builds its run with it (``build``); ``launch`` and ``plan`` check a
recipe with it (``parse``), with the same keys, types and checks and the command-line overrides applied.

A recipe is a LightningCLI config: ``task`` picks the module and datamodule classes, ``model`` and ``data`` are their
init arguments, ``trainer`` the Trainer's, plus ``output_dir``, ``seed``, ``logger``, ``checkpoint_every_n_steps``,
``keep_checkpoints``, ``ckpt_path`` (``last`` resumes from the newest complete checkpoint of the run) and
``overwrite``. Parsing refuses an unknown (or abbreviated) key and a wrong type, ``check_trainer`` the Trainer values a
run relies on, and the module and datamodule check their own values as they are built. Every mistake is a
``UserError`` keyed from the recipe's top.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import importlib
import inspect
import logging
import netrc
import os
import re
import sys
import urllib.parse
import uuid
import warnings
from collections import abc
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml
from jsonargparse import ActionYesNo, ArgumentError, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_rl import dotted, run_folder, trl_names, validation
from lightning_rl.callbacks import ExportHuggingFace, LoggerAfterSetup, PeriodicAndFinalCheckpoint, RequeueOnSignal, RunSummary
from lightning_rl.checkpoints import saved_value, staged_checkpoint_io
from lightning_rl.console import StepProgressBar, quiet_third_party_noise
from lightning_rl.errors import RecipeError, UserError
from lightning_rl.models.paths import EMBEDDED
from lightning_rl.rollout.base import SHORT_NAMES, EngineSpec
from lightning_rl.same_run import check_same_run, leaves
from lightning_rl import strategies as our_strategies
from lightning_rl.strategies import check_strategy_request
from lightning_rl.toy.task import TRAIN_FILE

TASKS = {
    "sft": ("lightning_rl.modules.sft:SFTModule", "lightning_rl.data.sft:SFTDataModule"),
    "grpo": ("lightning_rl.modules.grpo:GRPOModule", "lightning_rl.data.prompts:PromptDataModule"),
}
RECIPE_KEY = "recipe"  # where a checkpoint keeps the resolved recipe of the run that wrote it
DESCRIPTION = ("Train with a recipe (a YAML file of the keys below) and/or keys on the command line "
               "(--model.learning_rate=1e-5); docs/recipe_reference.md lists them all.")


@dataclass
class LoggerSettings:
    """The ``logger:`` block. ``wandb`` logs offline when no credentials are configured.

    Args:
        kind: ``csv`` (OUTPUT_DIR/csv), ``wandb`` or ``none``. TRL: `report_to`.
        project: the W&B project (default: ``WANDB_PROJECT``, else ``lightning-rl``). Read by ``wandb`` only.
        name: the W&B run name (default: ``WANDB_NAME``, else the output folder's name). Read by ``wandb`` only.
        offline: force W&B offline (None: offline when no credentials are configured). ``WANDB_MODE=disabled`` logs nothing.
    """

    kind: Literal["csv", "wandb", "none"] = "csv"
    project: str | None = None
    name: str | None = None
    offline: bool | None = None


def _import(target: str) -> Any:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def task_classes(task: str) -> tuple[type[LightningModule], type[LightningDataModule]]:
    validation.one_of("task", task, TASKS)
    try:
        return _import(TASKS[task][0]), _import(TASKS[task][1])
    except ImportError as e:
        raise RecipeError(f"task: {task!r} is not available in this install ({e})", "task") from None


def overlays(overrides: list[str]) -> list[Path]:
    """The recipe files laid over the recipe (``--config=FILE``, as LightningCLI's later ``-c`` files), in order."""
    return [Path(arg.split("=", 1)[1]) for arg in overrides if arg.startswith("--config=")]


def _with_overlays_spelled_out(overrides: list[str]) -> list[str]:
    """``overrides`` with ``-c FILE`` and ``--config FILE`` written ``--config=FILE`` (as `cli.run_arguments` writes
    them; launch and plan pass theirs on as given), and a file laid over the recipe that sets nothing left out."""
    spelled, k = [], 0
    while k < len(overrides):
        arg = overrides[k]
        if arg in ("-c", "--config") and k + 1 < len(overrides):
            arg, k = f"--config={overrides[k + 1]}", k + 1
        k += 1
        path = Path(arg.split("=", 1)[1]) if arg.startswith("--config=") else None
        if path is not None and path.is_file() and _sets_nothing(path):
            continue
        spelled.append(arg)
    return spelled


def _sets_nothing(path: Path) -> bool:
    try:
        return yaml.safe_load(path.read_text()) is None
    except (yaml.YAMLError, UnicodeDecodeError):
        return False  # said where it is read


def read_task(recipe: Path | None, overrides: list[str]) -> str:
    """The recipe's ``task`` (a ``--task=...`` override wins, then the last file laid over the recipe that says it),
    read before the full parse picks classes, from files that hold each key once (YAML would keep the last of two
    silently, and so would the parser). Without a recipe file the command line names it."""
    given = [arg.split("=", 1)[1] for arg in overrides if arg.startswith("--task=")]
    laid = []
    for overlay in overlays(overrides):
        config = _read_recipe_file(overlay) or {}  # comments alone set nothing
        if cleared := [block for block in ("model", "data", "trainer", "logger") if block in config and config[block] is None]:
            raise RecipeError(f"{overlay}: {cleared[0]}: null would clear the recipe's whole {cleared[0]} block: leave it out, "
                              f"or set the keys inside it")
        laid += [config["task"]] if "task" in config else []
    given = given or [str(task) for task in laid]
    if recipe is None:
        if not given:
            raise RecipeError(f"command line: give a recipe file or --task (one of {', '.join(TASKS)})", "task")
        return given[-1]
    config = _read_recipe_file(recipe)
    if given:
        return given[-1]
    if not isinstance(config, dict) or "task" not in config:
        near = difflib.get_close_matches("task", [str(key).lower() for key in config or {}], n=1, cutoff=0.7)
        written = next((str(key) for key in config or {} if near and str(key).lower() == near[0]), None)
        hint = f"; the recipe has {written!r}: did you mean 'task'?" if written else ""
        raise RecipeError(f"{recipe}: missing key 'task' (one of {', '.join(TASKS)}){hint}")
    return str(config["task"])


def _read_recipe_file(recipe: Path) -> Any:
    """A recipe file's content, refused in one line where it is not a recipe: missing, not YAML, not a mapping, a
    block given a value, a key written twice, a shell variable."""
    if recipe.is_dir():
        found = sorted(p.name for p in recipe.glob("*.y*ml"))[:5]
        raise RecipeError(f"{recipe}: a folder, not a recipe file" + (f" (it holds {', '.join(found)})" if found else ""))
    if not recipe.is_file():
        raise RecipeError(f"{recipe}: no such recipe file")
    try:
        text = recipe.read_text()
        config = yaml.safe_load(text)
        _refuse_repeated_keys(recipe, yaml.compose(text, Loader=yaml.SafeLoader))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)  # where the parser stopped, and what it found there
        if mark is not None:
            raise RecipeError(f"{recipe}: line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({e.problem})") from None
        raise RecipeError(f"{recipe}: not valid YAML ({str(e).splitlines()[0]})") from None
    if config is not None and not isinstance(config, dict):
        raise RecipeError(f"{recipe}: a recipe is a mapping of keys (task:, model:, data:, ...), not a {type(config).__name__}")
    for block in ("model", "data", "trainer", "logger"):
        value = (config or {}).get(block)
        if value is not None and not isinstance(value, dict):
            example = "{kind: wandb}" if block == "logger" else "{key: value, ...}"
            raise RecipeError(f"{recipe}: {block} is a block of keys ({block}: {example}), got {value!r}")
    _refuse_unexpanded_variables(recipe, config)
    return config


def _refuse_unexpanded_variables(recipe: Path, value: Any, key: str = "") -> None:
    """Refuse a shell variable in a recipe value (``${SCRATCH}/runs``, ``$HOME/data``): a recipe is not a shell script,
    and the value was taken as written (a folder named ``${SCRATCH}``)."""
    if isinstance(value, dict):
        for name, inner in value.items():
            _refuse_unexpanded_variables(recipe, inner, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for k, inner in enumerate(value):
            _refuse_unexpanded_variables(recipe, inner, f"{key}[{k}]")
    elif isinstance(value, str) and (found := re.search(r"\$\{(\w+)\}|^\$([A-Za-z_]\w*)", value)):
        name = found[1] or found[2]
        raise RecipeError(
            f"{recipe}: {key}: {value!r} names the variable {name}, which a recipe does not expand: write its value, or "
            f"give the key on the command line (--{key}=...), where the shell expands it"
        )


def _refuse_repeated_keys(recipe: Path, root: yaml.Node | None) -> None:
    """Refuse a key written twice in one mapping of the recipe (a second ``model:`` block, a repeated key inside a
    block), naming it dotted from the top and both lines."""
    todo, seen_nodes = [(root, "")], set()
    while todo:
        node, where = todo.pop()
        if id(node) in seen_nodes:  # an alias shares its anchor's node
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo += [(item, f"{where}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
                    continue  # `<<: *anchor` merges another mapping's keys under these ones, on purpose
                name = f"{where}.{key.value}" if where else key.value
                if (key.tag, key.value) in lines:
                    first = lines[(key.tag, key.value)]
                    raise RecipeError(
                        f"{recipe}: {name} is written twice (lines {first} and {key.start_mark.line + 1}); YAML would keep "
                        "only the second: write it once"
                    )
                lines[(key.tag, key.value)] = key.start_mark.line + 1
                todo.append((value, name))


# Trainer arguments the run cannot honour as Lightning would: the values it takes, and what to give instead.
_RUN_TRAINER = {
    "logger": ((None, False), "the run's logger is the top-level logger block (logger.kind: csv, wandb or none)"),
    "enable_checkpointing": ((None, True), "a run always checkpoints (resume and preemption rely on it): "
                             "checkpoint_every_n_steps sets how often"),
    "barebones": ((False,), "barebones mode turns off what every run writes (its summary, logs, checkpoints): for a "
                  "quick check give --trainer.max_steps"),
    "fast_dev_run": ((None, False), "it skips the recipe.yaml that marks output_dir as this run's, its logs and "
                     "checkpoints: for a quick check give --trainer.max_steps=1"),
    "use_distributed_sampler": ((None, False), "the datamodules deal rows to the ranks themselves (packed rows, in a "
                                "resumable order)"),
}  # fmt: skip
# GRPO steps its optimizer itself (manual optimization), which Lightning's accumulation and clipping do not reach.
_GRPO_TRAINER = {
    "accumulate_grad_batches": ((None, 1), "it takes one optimizer step per batch of rollouts: a larger step is more "
                                "prompts (data.batch_size) or completions (model.num_generations), and "
                                "model.max_tokens_per_row splits it into micro-batches whose gradients are accumulated"),
    "gradient_clip_val": ((None, 0), "it clips the gradient norm itself: set model.max_grad_norm (null: no clipping)"),
    "gradient_clip_algorithm": ((None,), "it clips the gradient norm itself, over every mesh the weights live on: set "
                                "model.max_grad_norm (null: no clipping)"),
    "limit_val_batches": ((None, 0, 1.0), "it runs no validation batches: its held-out evaluation decodes the first "
                          "model.eval_generations prompts of model.eval_data"),
    "check_val_every_n_epoch": ((None, 1), "it runs no validation loop: its held-out evaluation runs every "
                                "trainer.val_check_interval steps (model.eval_data)"),
}  # fmt: skip


def check_trainer(trainer: Any, task: str | None = None, sized_only: bool = False) -> None:
    """The ``trainer`` values a run relies on that Lightning's types leave open (or refuses only mid-run), and the
    Trainer arguments the run, or the ``task``, cannot honour. A recipe ``sized_only`` (``lightning-rl plan``) is
    never run, so a run without end is not refused."""
    for key, (taken, why) in {**_RUN_TRAINER, **(_GRPO_TRAINER if task == "grpo" else {})}.items():
        if trainer.get(key) not in taken:
            who = "GRPO" if key in _GRPO_TRAINER else "a run"
            raise RecipeError(f"trainer.{key}={trainer.get(key)!r} is not taken by {who}: {why}", f"trainer.{key}")
    precision = trainer.get("precision")
    if precision is not None:
        validation.precision(precision)
    if trainer.get("accumulate_grad_batches") is not None:
        validation.positive_int("trainer.accumulate_grad_batches", trainer["accumulate_grad_batches"])
    for key in ("max_steps", "max_epochs"):
        value = trainer.get(key)
        if value is not None and value != -1 and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RecipeError(f"trainer.{key} must be -1 (no limit) or >= 1, got {value!r}", f"trainer.{key}")
    if task == "grpo" and not sized_only and trainer.get("max_steps") in (None, -1) and trainer.get("max_epochs") in (None, -1):
        raise RecipeError("a GRPO run draws prompt batches without end: give trainer.max_steps, or trainer.max_epochs (passes "
                          "over its prompts)", "trainer.max_steps")
    if trainer.get("gradient_clip_val") is not None:
        validation.finite_non_negative("trainer.gradient_clip_val", trainer["gradient_clip_val"])
    _check_devices(trainer.get("devices"), trainer.get("accelerator"))
    if isinstance(trainer.get("strategy"), str):  # Lightning refuses an unknown name only as it builds the Trainer
        resolve_strategy(trainer["strategy"])
    interval = trainer.get("val_check_interval")  # Lightning divides by both, or refuses them only once fitting
    if interval is not None and (isinstance(interval, bool) or not (isinstance(interval, int) and interval >= 1 or isinstance(interval, float) and 0 < interval <= 1)):
        raise RecipeError(f"trainer.val_check_interval must be null, a number of training batches >= 1 or a fraction of an "
                          f"epoch in (0, 1], got {interval!r}", "trainer.val_check_interval")
    if trainer.get("check_val_every_n_epoch") is not None:
        validation.positive_int("trainer.check_val_every_n_epoch", trainer["check_val_every_n_epoch"])


def check_precision_here(trainer: Any) -> None:
    """A precision this machine's accelerator does not run, which Lightning would swap for another, is refused."""
    precision = trainer.get("precision")
    if precision is not None and validation.precision(precision) == "16-mixed" and _runs_on_cpu(trainer.get("accelerator")):
        raise RecipeError(f"trainer.precision={precision}: float16 mixed precision does not run on a CPU (Lightning would run "
                          "bf16-mixed in its place, and the run record 16-mixed): give bf16-mixed", "trainer.precision")


def _runs_on_cpu(accelerator: Any) -> bool:
    """Whether ``trainer.accelerator`` is, or ``auto`` resolves to, the CPU (no CUDA, MPS or XLA device here)."""
    if accelerator == "cpu":
        return True
    if accelerator not in (None, "auto"):
        return False
    import torch

    mps = getattr(torch.backends, "mps", None)
    return not torch.cuda.is_available() and not (mps is not None and mps.is_available()) and importlib.util.find_spec("torch_xla") is None


def _check_devices(devices: Any, accelerator: Any) -> None:
    """``trainer.devices`` as Lightning reads it (``validation.devices``); a CPU has no device indices."""
    if isinstance(validation.devices(devices), list) and accelerator == "cpu":
        raise RecipeError(f"trainer.devices: a CPU run takes a number of processes, not device indices, got {devices!r}", "trainer.devices")


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname  # a self-hosted server's too
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "api.wandb.ai") is not None  # NETRC as wandb reads it
    except (OSError, netrc.NetrcParseError):
        return False


def check_logger(settings: LoggerSettings) -> None:
    """What a logger needs from this machine, refused before the run writes anything: an online W&B run, credentials."""
    quiet = os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun")  # wandb sends nothing in these modes
    if settings.kind == "wandb" and settings.offline is False and not quiet and not has_wandb_credentials():
        raise RecipeError("logger.offline: false logs to W&B online, but no credentials are set (WANDB_API_KEY, or `wandb login`); "
                          "log them in, or leave logger.offline unset to log offline and `wandb sync` later", "logger.offline")


def build_logger(settings: LoggerSettings, output_dir: Path) -> Logger | bool:
    """The run's logger. W&B's project and run name come from the recipe, else from ``WANDB_PROJECT`` and
    ``WANDB_NAME`` as wandb reads them, else ``lightning-rl`` and the output folder's name. ``WANDB_MODE=disabled``
    means no W&B logger at all (an offline one would still write its folder)."""
    if settings.kind == "none":
        return False
    if settings.kind == "csv":
        return CSVLogger(save_dir=output_dir, name="csv")
    check_logger(settings)
    if os.environ.get("WANDB_MODE") == "disabled":
        print("W&B: WANDB_MODE=disabled: this run logs nothing to W&B (unset WANDB_MODE to log)", file=sys.stderr)
        return False
    offline = settings.offline if settings.offline is not None else (os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not has_wandb_credentials())
    run_id = None  # wandb's own: WANDB_RUN_ID where set
    if offline:
        print(f"W&B: logging offline to {output_dir}/wandb; upload later with `wandb sync {output_dir}/wandb/offline-run-*`", file=sys.stderr)
        if os.environ.get("WANDB_RUN_ID"):
            print(f"W&B: WANDB_RUN_ID={os.environ['WANDB_RUN_ID']} cannot resume an offline run: this one logs a history of its own "
                  "(log in to resume it online)", file=sys.stderr)
            run_id = uuid.uuid4().hex[:8]  # a new id: the user's would be a second offline folder under it
    return RecipeWandbLogger(project=settings.project or os.environ.get("WANDB_PROJECT") or "lightning-rl",
                             name=settings.name or os.environ.get("WANDB_NAME") or output_dir.name, save_dir=str(output_dir),
                             offline=offline, id=run_id)


class RecipeWandbLogger(WandbLogger):
    """Lightning's W&B logger, whose start (``wandb.init``, at the logger's first use as training starts) fails as one
    ``RecipeError``: a W&B server it cannot reach, or a run folder it cannot write. ``lightning-rl run`` then takes
    back what the run wrote, as for any run refused before its first step, so the corrected rerun starts there."""

    @property
    def experiment(self) -> Any:
        import wandb

        try:
            return super().experiment
        except (wandb.errors.CommError, ConnectionError, TimeoutError) as error:
            raise RecipeError(f"logger.offline: W&B could not start the run online ({' '.join(str(error).split())}); log offline "
                              "with logger.offline: true (or WANDB_MODE=offline) and `wandb sync` later", "logger.offline") from None
        except OSError as error:
            raise RecipeError(f"output_dir: W&B cannot write its run folder in {self.save_dir}/wandb ({error})", "output_dir") from None


def recipe_text(parser: Any, config: Any) -> str:
    """The resolved recipe as recipe.yaml, each checkpoint and the logged hyperparameters give it."""
    config = config.clone()
    config.overwrite = False  # rerunning the saved recipe must not replace this run
    return parser.dump(config, skip_none=False)


class SaveRecipe(SaveConfigCallback):
    """The run's first writes, once its model and data are set up: with ``--overwrite`` the previous run's files go
    (``lightning_rl/run_folder.py``: only those), then the resolved recipe is written to OUTPUT_DIR/recipe.yaml
    (atomically) under the marker that makes the folder a run's. After the export, the run lists hf/'s files. Each
    checkpoint keeps the recipe too, and a resume that changes what it trains is refused (``lightning_rl/same_run.py``)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pass  # where SaveConfigCallback writes: too early, the model is not set up yet

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        output_dir = Path(self.config["output_dir"])
        if self.config["overwrite"]:  # set aside until the first step is trained: a refusal before it loses nothing
            run_folder.set_aside_run_files(output_dir)
        path = output_dir / run_folder.RECIPE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(run_folder.marked(self.recipe_text()), encoding="utf-8")
        os.replace(tmp, path)
        self.wrote = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step >= 1 and not getattr(self, "dropped", False):
            run_folder.drop_set_aside(Path(self.config["output_dir"]))  # the new run has trained: the earlier one goes
            self.dropped = True

    def recipe_text(self) -> str:
        """The resolved recipe, as the run folder and each checkpoint keep it."""
        return recipe_text(self.parser, self.config)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[RECIPE_KEY] = self.recipe_text()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        check_same_run(checkpoint.get(RECIPE_KEY), self.recipe_text(), trainer.ckpt_path)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:  # after ExportHuggingFace, which comes earlier among the callbacks
            run_folder.record_export(Path(self.config["output_dir"]))
            run_folder.drop_set_aside(Path(self.config["output_dir"]))  # a run of no step finished all the same


def _lists_replaced(parser: LightningArgumentParser, args: list[str]) -> list[str]:
    """``args`` with an empty list set before each list that the command line gives a key holding one: jsonargparse
    merges a list into the recipe's element by element when both have the same length (each entry keeping what it
    does not restate, e.g. a reward's weight and kwargs), and a list given in full must replace the recipe's."""
    replaced = []
    for i, arg in enumerate(args):
        key, equals, value = arg.partition("=")
        if key == "--config" and equals:  # a file laid over the recipe: its lists replace the recipe's too
            for dotted_key, listed in _dotted_items(yaml.safe_load(Path(value).read_text()) or {}):
                action = parser._option_string_actions.get(f"--{dotted_key}")
                if isinstance(listed, list) and _holds_a_list(getattr(action, "_typehint", None)):
                    replaced.append(f"--{dotted_key}=[]")
        if not equals and i + 1 < len(args):
            value = args[i + 1]  # `--key VALUE`
        # jsonargparse's table of flags, and an action's type: the one place that says a key holds a list
        action = parser._option_string_actions.get(key) if key.startswith("--") else None
        if value.lstrip().startswith("[") and _holds_a_list(getattr(action, "_typehint", None)):
            replaced.append(f"{key}=[]")
        replaced.append(arg)
    return replaced


def _refuse_item_fields_of_a_whole_list(schema: _Schema, args: list[str]) -> None:
    """Refuse ``--model.rewards.weight=3``: jsonargparse sets the field of the list's last item alone, which reads as
    every item's. After ``--model.rewards+=ITEM`` it is that item's field, as jsonargparse means it."""
    appended = set()
    for arg in args:
        key = arg.partition("=")[0].removeprefix("--") if arg.startswith("--") else ""
        if key.endswith("+") or key in schema.item_keys:  # an item appended, or the whole list given: its last is known
            appended.add(key.removesuffix("+"))
            continue
        for listed in schema.item_keys:
            if key.startswith(f"{listed}.") and listed not in appended:
                raise RecipeError(f"command line: --{key} would set the field of the last item of {listed} alone: give "
                                  f"the whole list (--{listed}='[{{...}}, ...]'), or the field after the item it belongs "
                                  f"to (--{listed}+='{{...}}' --{key}=...)")


def _dotted_items(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every value of a recipe's nested mappings, the mappings' own too."""
    found = []
    for key, value in node.items() if isinstance(node, dict) else []:
        found.append((f"{prefix}{key}", value))
        found += _dotted_items(value, f"{prefix}{key}.")
    return found


def _holds_a_list(typehint: Any) -> bool:
    if get_origin(typehint) in (Union, UnionType):
        return any(_holds_a_list(option) for option in get_args(typehint))
    return get_origin(typehint) in (list, abc.Sequence, abc.MutableSequence)


def check_engine_here(model: Any) -> None:
    """A GRPO run's rollout engine checked against this machine (a dtype, a device, vLLM installed), before any model
    loads. Only for a run: a launch reads the recipe on another machine than the one that runs it."""
    engine = model.get("engine") if isinstance(model, Namespace) else None
    if engine is None:
        return
    try:
        EngineSpec.of(engine.as_dict() if isinstance(engine, Namespace) else engine).check_here()
    except ValueError as error:
        option = re.match(r"(\w+): (.*)", str(error))
        raise (RecipeError(f"model.engine: {error}", "model.engine") if option is None else
               RecipeError(option[2], f"model.engine.init_args.{option[1]}")) from None  # fmt: skip


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipe's top-level keys, its checks, and the callbacks every run gets. With
    ``build=False`` it parses and checks the recipe and builds nothing."""

    def __init__(self, *args: Any, build: bool = True, sized_only: bool = False, recipe: str | None = None,
                 overrides: list[str] = (), **kwargs: Any) -> None:
        self.build, self.sized_only = build, sized_only
        self.recipe, self.overrides = recipe, list(overrides)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--task", type=Literal[tuple(TASKS)], required=True, help="what to train: " + ", ".join(TASKS))
        parser.add_argument("--output_dir", type=str, default="outputs/run", help="checkpoints, summary.json, hf/ and logs. TRL: `output_dir`.")
        parser.add_argument("--seed", type=int, default=0, help="the run's seed: weights' init, data order, sampling. TRL: `seed`.")
        parser.add_argument("--checkpoint_every_n_steps", type=int | None, default=100, help="optimizer steps between checkpoints (checkpoints/); null: none but the last step's (and a stop signal's). TRL: `save_steps`.")
        parser.add_argument("--keep_checkpoints", type=int, default=1, help="the newest periodic checkpoints kept (last.ckpt besides). TRL: `save_total_limit`.")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from, or 'last'. TRL: `resume_from_checkpoint`.")
        parser.add_argument("--overwrite", action=ActionYesNo, nargs="?", default=False, help="replace the outputs of an earlier run in output_dir")
        parser.add_class_arguments(LoggerSettings, "logger")
        docs = key_docs(self.model_class, self.datamodule_class)
        for action in parser._actions:  # jsonargparse reads one docstring entry per argument; ours may name several
            if not action.help and action.dest in docs:
                action.help = docs[action.dest]
        parser.link_arguments("seed", "seed_everything")
        parser.link_arguments("output_dir", "trainer.default_root_dir")
        for group, cls in (("model", self.model_class), ("data", self.datamodule_class)):  # GRPO's sampling, data order
            if "seed" in inspect.signature(cls).parameters:
                parser.link_arguments("seed", f"{group}.seed")
        if "tokenizer" in inspect.signature(self.datamodule_class).parameters and "model_name_or_path" in inspect.signature(self.model_class).parameters:
            parser.link_arguments("model.model_name_or_path", "data.tokenizer")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if isinstance(args, list):
            _refuse_item_fields_of_a_whole_list(_Schema(parser), args)
        try:
            super().parse_arguments(parser, _lists_replaced(parser, args) if isinstance(args, list) else args)
        except ArgumentError:
            # jsonargparse stops at the first key it does not know: name them all, each where it was written
            if problems := self.misplaced_keys(parser):
                raise RecipeError("; ".join(problems)) from None
            raise

    def misplaced_keys(self, parser: LightningArgumentParser) -> list[str]:
        """Every key of the recipe file and the command line that the schema does not take, as ``WHERE: unknown
        key 'KEY' (HINT)``: a key of the other task, the nearest key of this one, or the key a linked one is set from."""
        schema = _Schema(parser)
        problems, engine = [], _engine_name(self.recipe, self.overrides)[1]
        for recipe in [*([self.recipe] if self.recipe is not None else []), *overlays(self.overrides)]:
            root = yaml.compose(Path(recipe).read_text(), Loader=yaml.SafeLoader)
            problems += [f"{recipe}: line {line}: {schema.problem(key, self.task, engine)}" for key, line in schema.unknown_in(root)]
        options = _engine_options(engine)
        for key in dict.fromkeys(_override_keys(self.overrides)):
            option = key.removeprefix("model.engine.init_args.")
            if not schema.takes(key) or (option != key and options is not None and option not in options):
                problems.append(f"command line: {schema.problem(key, self.task, engine)}")
        return problems

    @property
    def task(self) -> str:
        return next(name for name, (module, _) in TASKS.items() if module.endswith(f":{self.model_class.__name__}"))

    def before_instantiate_classes(self) -> None:
        if self.config["checkpoint_every_n_steps"] is not None:
            validation.positive_int("checkpoint_every_n_steps", self.config["checkpoint_every_n_steps"])
        validation.positive_int("keep_checkpoints", self.config["keep_checkpoints"])
        if not str(self.config["output_dir"]).strip():
            raise RecipeError(f"output_dir must name a folder, got {self.config['output_dir']!r}", "output_dir")
        # ~ as the shell reads it, once for every reader: Lightning's checkpoints and logs expanded it, the run's own
        # files did not (a folder named ~ in the working directory, and a resume that found no checkpoint).
        for key, value in (("output_dir", self.config["output_dir"]), ("ckpt_path", self.config["ckpt_path"])):
            if isinstance(value, str) and value.startswith("~"):
                self.config[key] = os.path.expanduser(value)
        self.config["trainer"]["default_root_dir"] = self.config["output_dir"]
        if self.config["overwrite"] and self.config["ckpt_path"] is not None:
            raise RecipeError(
                f"overwrite: --overwrite starts the run in output_dir over, --ckpt_path={self.config['ckpt_path']} resumes "
                "a run: give one of them", "overwrite",
            )  # fmt: skip
        check_trainer(self.config["trainer"], self.config["task"], self.sized_only)
        if self.build:  # what this machine runs
            check_engine_here(self.config["model"])
            check_precision_here(self.config["trainer"])
        else:  # launch, plan: the module's and the data's own checks of their values, as `run` makes them (the model
            # and the data files are not read: they may be on the cluster alone)
            data = self.config["data"].as_dict()
            data["path" if data.get("path") is not None else "train_data"] = str(TRAIN_FILE)  # GRPO's earlier name kept
            data.update({"val_data": None} if "val_data" in data else {})
            for cls, arguments in ((self.model_class, {**self.config["model"].as_dict(), "model_name_or_path": EMBEDDED[0]}),
                                   (self.datamodule_class, data)):
                try:
                    cls(**arguments)
                except UserError:
                    raise  # keyed by its block where the parse is (`keyed`)
                except (ValueError, MisconfigurationException) as error:  # as `instantiate_classes` says it
                    raise RecipeError(" ".join(str(error).split())) from None

    def instantiate_classes(self) -> None:
        if not self.build:
            return
        try:
            super().instantiate_classes()
        except UserError:
            raise
        except (ValueError, MisconfigurationException) as error:  # a recipe class refusing its arguments as it is built
            raise RecipeError(" ".join(str(error).split())) from None

    def keyed(self, error: UserError) -> UserError:
        return keyed(error, self.model_class, self.datamodule_class)

    def check_resume(self, ckpt_path: str) -> None:
        """Refuse a checkpoint of a run whose recipe this one changes (`check_same_run`): `run` asks when the weights
        did not fit, which the module finds first (a changed ``loss.beta`` adds or removes the reference model's), so
        that the changed key is named with both values rather than reported as another module's weights."""
        check_same_run(saved_value(ckpt_path, RECIPE_KEY), recipe_text(self.parser, self.config), ckpt_path)

    def wrote_run_folder(self) -> bool:
        """Whether this run has written its recipe.yaml (and so made output_dir its run folder)."""
        return any(getattr(callback, "wrote", False) for callback in self.trainer.callbacks if isinstance(callback, SaveRecipe))

    def _set_seed(self) -> None:
        seed = self.config.get("seed")
        if isinstance(seed, int) and not 0 <= seed < 2**32:  # NumPy's range, which seeding every library needs
            raise RecipeError(f"seed must be in [0, 2**32 - 1], got {seed}")  # no key: data.seed is linked from it
        if self.build:  # a recipe only checked (launch, plan) has nothing to seed
            said = logging.getLogger("lightning.fabric.utilities.seed")  # "Seed set to 0", before any error line:
            level = said.level  # the seed is in recipe.yaml
            said.setLevel(logging.WARNING)  # (setLevel, not the attribute: it clears the loggers' cached levels)
            try:
                super()._set_seed()
            finally:
                said.setLevel(level)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init
        strategy, accelerator = config["trainer"].get("strategy"), config["trainer"].get("accelerator")
        if isinstance(strategy, str) and (cls := _strategy_class(strategy)) is not None:  # a class named alone: built
            config["trainer"]["strategy"] = strategy = _built_strategy(cls, strategy, accelerator)  # with its defaults
        if isinstance(strategy, str) or accelerator == "tpu":  # refuse what this machine cannot run before Lightning starts on it
            check_strategy_request(strategy if isinstance(strategy, str) else "auto", accelerator if isinstance(accelerator, str) else None)
        output_dir = Path(config["output_dir"])
        self.requeue = RequeueOnSignal(output_dir)
        logger = build_logger(config["logger"], output_dir)
        callbacks = config["trainer"].get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]  # one given alone
        if config["trainer"].get("enable_progress_bar") is not False:
            callbacks.append(StepProgressBar())
        callbacks += [
            RunSummary(output_dir, task=config["task"]),  # its figures before the export (which merges LoRA in place)
            ExportHuggingFace(output_dir),
            self.requeue,  # the modules bring StopOnNonFinite, ScheduleOnResume and ValidationOnResume themselves
            *([LoggerAfterSetup(logger, leaves(yaml.safe_load(recipe_text(self.parser, self.config))))] if logger else []),
            PeriodicAndFinalCheckpoint(
                dirpath=output_dir / "checkpoints",
                filename="{step}",
                every_n_train_steps=config["checkpoint_every_n_steps"] or 0,  # 0: Lightning's periodic saves off
                save_top_k=config["keep_checkpoints"],  # the newest: ranked by step
                monitor="step",
                mode="max",
                save_last=True,
                # Not put off to a validation at an epoch's last batch: Lightning assumes one follows it, and with
                # validation every n steps none may (the save then came a micro-batch late, mid-step, or never).
                save_on_train_epoch_end=True,
            ),
        ]
        try:
            trainer = super().instantiate_trainer(callbacks=callbacks, logger=False, **kwargs)
        except UserError:
            raise
        except (ValueError, MisconfigurationException) as error:  # Lightning's words, with the key they are about
            raise _trainer_refusal(error, config["trainer"]) from None
        trainer.strategy.checkpoint_io = staged_checkpoint_io(trainer.strategy.checkpoint_io)
        if hasattr(self.datamodule, "check_strategy"):  # said once, before the processes start (each would say it)
            self.datamodule.check_strategy(trainer)
        return trainer


def _strategy_class(name: str) -> type | None:
    """The Strategy class a ``trainer.strategy`` string names by its class name or dotted path (Lightning reads a
    string as a registered name only: ``DDPStrategy`` was an invalid name), None for a registered name or another."""
    from lightning.pytorch import strategies
    from lightning.pytorch.strategies import Strategy, StrategyRegistry

    if name in StrategyRegistry or name == "auto":
        return None
    found = getattr(strategies, name, None) or getattr(our_strategies, name, None)
    if found is None and "." in name:
        try:
            found = dotted.load_object(name, "trainer.strategy")
        except Exception:
            return None
    return found if isinstance(found, type) and issubclass(found, Strategy) else None


def resolve_strategy(strategy: Any) -> type | None:
    """The Strategy class a ``trainer.strategy`` value names, as the run resolves it: a registered name (in any case, as
    Lightning reads it), a class by its name or dotted path, or ``{class_path: ...}``; None for ``auto`` (Lightning
    chooses at the run). A name that is none of these is refused, with the nearest registered name where one is close."""
    from lightning.pytorch.strategies import StrategyRegistry

    name = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    if not isinstance(name, str) or name.lower() == "auto":
        return None
    if name.lower() in StrategyRegistry:
        return StrategyRegistry[name.lower()]["strategy"]
    found = _strategy_class(name)
    if found is None:
        guess = difflib.get_close_matches(name.lower(), list(StrategyRegistry), n=1, cutoff=0.6)
        hint = f"did you mean '{guess[0]}'?" if guess else "give a registered name (ddp, fsdp2, cpu_static, ...; `lightning-rl env` lists ours)"
        raise RecipeError(f"trainer.strategy={name} is neither a registered strategy name nor a Strategy class: {hint}", "trainer.strategy")
    return found


def _built_strategy(cls: type, name: str, accelerator: Any) -> Any:
    """``cls`` built with its defaults, as ``{class_path: ...}`` builds it, once what this machine cannot run under its
    registered name is refused; one that cannot be built so (abstract, or needing arguments) is refused in one line."""
    from lightning.pytorch.strategies import StrategyRegistry

    for registered, entry in StrategyRegistry.items():
        if entry["strategy"] is cls and not entry.get("init_params"):
            check_strategy_request(registered, accelerator if isinstance(accelerator, str) else None)
            break
    if inspect.isabstract(cls):
        raise RecipeError(f"trainer.strategy={name} is an abstract class: name a strategy that runs (DDPStrategy, FSDP2Strategy, "
                          "or a registered name such as ddp, fsdp2)", "trainer.strategy")
    try:
        return cls()
    except (TypeError, ValueError, MisconfigurationException) as error:
        raise RecipeError(f"trainer.strategy={name}: {cls.__name__}() failed: {' '.join(str(error).split())} (a strategy that "
                          f"needs options takes them as --trainer.strategy.class_path={name} --trainer.strategy.init_args.OPTION=VALUE)",
                          "trainer.strategy") from None


def _trainer_refusal(error: Exception, trainer: dict[str, Any]) -> RecipeError:
    """Lightning's refusal of a Trainer argument, naming the ``trainer.`` key whose value it names (``No supported gpu
    backend found!`` is ``trainer.accelerator=gpu``'s; a number is too common a word to tell), else Lightning's words:
    a value it quotes first (its list of choices names others)."""
    said = " ".join(str(error).split())
    for quoted, flags in ((r"['\"]{}['\"]", re.IGNORECASE), (r"(?<![\w.]){}(?![\w.])", 0)):
        for key, value in trainer.items():
            if isinstance(value, str) and re.search(quoted.format(re.escape(value)), said, flags):
                return RecipeError(f"trainer.{key}={value}: {said}", f"trainer.{key}")
    return RecipeError(said)


# A key of one task written in a recipe of the other, with what this task has instead.
_OTHER_TASK_HINTS = {
    ("sft", "data.batch_size"): "SFT batches by tokens: data.max_tokens",
    ("sft", "data.path"): "the data file is data.train_data",
    ("grpo", "data.max_tokens"): "a GRPO step is data.batch_size prompts x model.num_generations completions; "
    "model.max_tokens_per_row bounds a packed micro-batch",
    ("grpo", "data.val_data"): "GRPO's held-out data is model.eval_data",
    ("sft", "model.max_grad_norm"): "SFT clips the gradient norm with trainer.gradient_clip_val",
}

_A = {"sft": "an SFT", "grpo": "a GRPO"}


class _Schema:
    """The keys a parser takes: leaves (a value each; a class-typed one takes its fields below it), groups of keys,
    and the keys set from another one (``output_dir --> trainer.default_root_dir``)."""

    def __init__(self, parser: LightningArgumentParser) -> None:
        self.parser = parser
        self.leaves, self.groups, self.linked = set(), set(), {}
        self.item_keys: dict[str, list[str]] = {}  # a list of blocks (model.rewards): the keys each item takes
        for action in parser._actions:
            if " --> " in (link := (action.option_strings or [""])[0]):
                self.linked[action.dest] = link.split(" --> ")[0]
            elif type(action).__name__ == "_ActionConfigLoad":
                self.groups.add(action.dest)
            elif action.dest not in ("help", "config", "print_config") and not action.dest.endswith(".help"):
                self.leaves.add(action.dest)
                fields = item_fields(action.dest, getattr(action, "_typehint", None))
                if fields and fields[0][0].startswith(f"{action.dest}[]."):
                    self.item_keys[action.dest] = [key.rpartition(".")[2] for key, _, _ in fields]

    def takes(self, key: str) -> bool:
        parts = key.split(".")
        return key in self.groups or any(".".join(parts[:n]) in self.leaves for n in range(1, len(parts) + 1))

    def unknown_in(self, node: yaml.Node | None, prefix: str = "") -> list[tuple[str, int]]:
        """The keys of a composed recipe the schema does not take, with their lines."""
        found = []
        for key, value in node.value if isinstance(node, yaml.MappingNode) else []:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            name = prefix + str(key.value)
            if name in self.groups:
                found += self.unknown_in(value, f"{name}.")
            elif not self.takes(name):
                found.append((name, key.start_mark.line + 1))
            elif name in self.item_keys and isinstance(value, yaml.SequenceNode):  # - function: ..., each item's keys
                for k, item in enumerate(value.value):
                    found += [(f"{name}[{k}].{option}", line) for option, line in _keys_with_lines(item)
                              if option not in self.item_keys[name]]
            elif name == "model.engine" and isinstance(value, yaml.MappingNode):  # class_path + init_args: its options
                given = {str(k.value): v for k, v in value.value if isinstance(k, yaml.ScalarNode)}
                options = _engine_options(given["class_path"].value if isinstance(given.get("class_path"), yaml.ScalarNode) else None)
                for option, line in _keys_with_lines(given.get("init_args")) if options is not None else []:
                    if option not in options:
                        found.append((f"{name}.init_args.{option}", line))
        return found

    def problem(self, key: str, task: str, engine: str | None = None) -> str:
        if (item := re.fullmatch(r"([\w.]+)\[\d+\]\.(\w+)", key)) and item[1] in self.item_keys:
            options = self.item_keys[item[1]]
            guess = difflib.get_close_matches(item[2], options, n=1, cutoff=0.6)
            hint = f"did you mean '{key.rpartition('.')[0]}.{guess[0]}'?" if guess else f"each item takes {', '.join(options)}"
            return f"unknown key '{key}' ({hint})"
        if key.startswith("model.engine.init_args.") and (options := _engine_options(engine)) is not None:
            guess = difflib.get_close_matches(key.rpartition(".")[2], options, n=1, cutoff=0.6)
            hint = f"did you mean 'model.engine.init_args.{guess[0]}'?" if guess else f"{engine} takes {', '.join(options)}"
            return f"unknown key '{key}' ({hint})"
        if key in self.linked:
            return f"{key} is set from {self.linked[key]}: give {self.linked[key]}"
        block, _, field = key.partition(".")
        for other in TASKS:
            if other != task and block in ("model", "data") and field:
                cls = task_classes(other)[block == "data"]
                if field.split(".")[0] in inspect.signature(cls).parameters or (task, key) in _OTHER_TASK_HINTS:
                    hint = _OTHER_TASK_HINTS.get((task, key))
                    return f"unknown key '{key}' ({_A[other]} key{'; ' + hint if hint else ''})"
        guess = self.nearest(key)
        field = key.rpartition(".")[2]
        if guess is None or guess.rpartition(".")[2] != field:  # a key of ours by that name is the better answer
            if trl := trl_names.hint(task, field, self.documented()):
                return f"unknown key '{key}' ({trl})"
        return f"unknown key '{key}'" + (f" (did you mean '{guess}'?)" if guess else "")

    def documented(self) -> list[tuple[str, str]]:
        """(key, doc) of every key, a dataclass-typed one's fields too (``model.sampling.temperature``,
        ``model.rewards[].weight``): where the TRL names of `trl_names.annotations` are written."""
        found = []
        for action in self.parser._actions:
            if action.dest in ("help", "config", "print_config") or action.dest.endswith(".help"):
                continue
            found.append((action.dest, " ".join((action.help or "").split())))
            found += [(key, " ".join(doc.split())) for key, _, doc in item_fields(action.dest, getattr(action, "_typehint", None))]
        return found

    def nearest(self, key: str) -> str | None:
        known = sorted((self.leaves | self.groups) - {"seed_everything"})
        field = key.rpartition(".")[2]
        same_field = [name for name in known if name.rpartition(".")[2] == field]
        if len(same_field) == 1:
            return same_field[0]
        head = key.partition(".")[0]
        for block in ("model.", "data.", "trainer."):  # a block left out (not a key inside a block of its own)
            if head not in self.groups and self.takes(block + key) and head not in _RUN_TRAINER:
                return block + key
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        return close[0] if close else None


def _override_keys(overrides: list[str]) -> list[str]:
    """The dotted keys a command line sets (``--a.b=1``, ``--a.b 1``, ``--a.b+=...``)."""
    keys = []
    for arg in overrides:
        if arg.startswith("--"):
            key = arg[2:].partition("=")[0].removesuffix("+")
            if key not in ("config", "print_config", "help") and not key.endswith(".help"):
                keys.append(key)
    return keys


def _among(key: str, written: abc.Iterable[str]) -> bool:
    """Whether ``written`` (dotted keys) holds ``key``, a key inside it, or the block holding it."""
    return any(key == given or key.startswith(f"{given}.") or given.startswith(f"{key}.") for given in written)


def _written_in(key: str, recipe: Path) -> bool:
    """Whether a recipe file writes ``key`` (or a key inside it, or the block holding it)."""
    return _among(key, (dotted for dotted, value in _dotted_items(yaml.safe_load(recipe.read_text()) or {}) if not isinstance(value, dict)))


def _written_on_command_line(key: str, overrides: list[str]) -> bool:
    return _among(key, _override_keys(overrides))


def item_fields(key: str, hint: Any) -> list[tuple[str, dataclasses.Field, str]]:
    """(key, field, doc) of each field of a block or list item typed by a dataclass (``model.lora.r``,
    ``model.rewards[].weight``); none for another type."""
    for candidate, inner in ((hint, key), *((arg, key) for arg in get_args(hint))):
        if get_origin(candidate) in (list, abc.Sequence):
            candidate, inner = get_args(candidate)[0], f"{key}[]"
        if dataclasses.is_dataclass(candidate):
            docs = docstring_args(candidate)
            return [(f"{inner}.{field.name}", field, docs.get(field.name, "")) for field in dataclasses.fields(candidate)]
    return []


_ARG = re.compile(r"^(\s*)([\w, ]+?):\s+(.*)$")


def docstring_args(cls: type) -> dict[str, str]:
    """``Args:`` entries of a class docstring, an entry naming several arguments (``a, b: ...``) given to each."""
    doc = inspect.getdoc(cls) or ""
    if "Args:" not in doc:
        return {}
    entries: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in doc.split("Args:", 1)[1].splitlines():
        match = _ARG.match(line)
        if match and (indent is None or len(match[1]) <= indent):
            indent = len(match[1])
            names = [name.strip() for name in match[2].split(",")]
            for name in names:
                entries[name] = match[3].strip()
        elif names and line.strip():
            for name in names:
                entries[name] += " " + line.strip()
    return entries


def key_docs(model_class: type, datamodule_class: type) -> dict[str, str]:
    """Each recipe key's one-line doc, from the ``Args:`` of the class (or dataclass) it sets."""
    docs = {f"logger.{name}": text for name, text in docstring_args(LoggerSettings).items()}
    for block, cls in (("model", model_class), ("data", datamodule_class)):
        docs.update({f"{block}.{name}": text for name, text in docstring_args(cls).items()})
        for name, hint in get_type_hints(cls.__init__).items():  # groups typed by a dataclass (loss:, sampling:)
            for candidate in (hint, *get_args(hint)):
                if dataclasses.is_dataclass(candidate):
                    docs.update({f"{block}.{name}.{field}": text for field, text in docstring_args(candidate).items()})
    return docs


_UNKNOWN_KEY = [
    (re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'"), lambda m: f"{m[1]}.{m[2]}"),
    (re.compile(r"Option '([\w.]+)' is not accepted"), lambda m: m[1]),
    (re.compile(r"unrecognized arguments: --([\w.]+)"), lambda m: m[1]),
]
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')
_EXPECTED = re.compile(r"Expected a (?:typing\.Literal\[(?P<options>[^\]]*)\]|<class '(?P<type>[\w.]+)'>)\. Got value: (?P<value>.*?)(?: - |\. Got value: |$)")
_LITERAL = re.compile(r"typing\.Literal\[([^\]]*)\]")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "NoneType": "null"}


def _choices(options: str) -> list[str]:
    return [option.strip().strip("'\"") for option in options.split(",")]


def _one_line(error: BaseException) -> str:
    """jsonargparse spreads a problem over several lines and type reprs; say it on one, in the recipe's words: an
    unknown key by name, a bad value as ``KEY must be ..., got VALUE`` (a mapping written ``{key:value}``, which YAML
    reads as one key ``key:value``, with how to write it)."""
    said = _said(error)
    if re.fullmatch(r"model\.warmup_steps must be an integer, got 0?\.\d+", said):  # TRL's warmup_ratio, as a count
        said += " (a share of the run, TRL's warmup_ratio, is given as its steps: the ratio x trainer.max_steps)"
    if re.fullmatch(r"model\.sampling\.(min_p|top_k) must be (a number|an integer), got None", said):  # TRL's None
        said += " (0 is off, as TRL's None)"
    if re.search(r"got \{[^}]*\w:[^\s/}]", said):
        said += " (YAML reads {key:value} as one key, 'key:value': write {key: value}, a space after each colon)"
    return said


def _said(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    keys = _PARSER_KEY.findall(text)
    for pattern, key in _UNKNOWN_KEY:
        if match := pattern.search(text):
            name = key(match)
            if keys and not name.startswith(keys[0]):  # an init argument of a class given by class_path
                name = f"{keys[0]}{'.init_args.' if _given_by_class_path(text) else '.'}{name}"
            return f"unknown key '{name}'"
    if keys and keys[0].endswith("rewards") and (bare := re.search(r"(?:Expected a dot import path string|Unexpected import path format): ([^\s\]]+)", text)):
        # A reward given by its name alone (rewards: [format]): jsonargparse reads it as a class to import.
        return (f"{keys[0]}: each reward is a block (function, weight, kwargs), got {bare[1]}: write "
                f"{{function: {bare[1]}}} (in a recipe, - function: {bare[1]})")
    if keys:
        key = keys[0] + "".join(f".{inner}" for inner in keys[1:] if not inner.startswith(keys[0]))  # a dataclass's field
        if block := _block_given_a_value(text[text.rindex('Parser key "') :]):  # model.lora=true
            return f"{key} is a block of keys ({key}.NAME=VALUE, or a mapping){block}"
        if match := _EXPECTED.search(text[text.rindex('Parser key "') :]):
            if match["options"] is not None:
                expected = f"one of {', '.join(_choices(match['options']))}"
            else:
                expected = _TYPE_WORDS.get(match["type"], f"a {match['type']}")
            return f"{key} must be {expected}, got {match['value']}"
        inner = text[text.rindex('Parser key "') :]  # the innermost key's own problem: a union of choices and types
        subtypes = re.search(r"Subtypes: \[(.*?)\] Errors:", inner)
        given = re.search(r"Given value: (.*?)(?:\. Got value: | Given value|$)", inner)
        if subtypes and given:
            choices = [choice for found in _LITERAL.findall(subtypes[1]) for choice in _choices(found)]
            types = [_TYPE_WORDS.get(name, f"a {name}") for name in re.findall(r"<class '([\w.]+)'>", subtypes[1])]
            if choices or types:
                choices = list(dict.fromkeys(choices))
                said = ([] if not choices else [choices[0]] if len(choices) == 1 else [f"one of {', '.join(choices)}"]) + types
                return f"{key} must be {', '.join(said[:-1]) + ' or ' if len(said) > 1 else ''}{said[-1]}, got {given[1]}"
        if (given := re.search(r"Given value: (.*)$", text)) and (options := _LITERAL.findall(text)):
            choices = list(dict.fromkeys(choice for found in options for choice in _choices(found)))
            return f"{key} must be one of {', '.join(choices)}, got {given[1]}"
        if match := re.search(r"Expected a tuple with (\d+) elements\. Got value: (.*?)(?: - |$)", text):
            return f"{key} must be a list of {match[1]} values, got {match[2]}"
        if match := re.search(r"Unable to load config '(.*?)'", text):  # a block (a settings group) given a scalar
            return f"{key} is a block of keys ({key}.NAME=VALUE, or a mapping), got {match[1]}"
    if match := re.search(r"the following arguments are required: ([\w.]+(?:, [\w.]+)*)$", text):  # a key set to null
        return f"{match[1]} must be given a value (it is missing, or null)"
    if match := re.fullmatch(r"argument --([\w.]+): expected one argument", text):
        return f"{match[1]}: no value given (--{match[1]}=VALUE)"
    return text if len(text) <= 400 else text[:400] + " ..."


def _block_given_a_value(inner: str) -> str | None:
    """For a key typed by a settings block (a dataclass, or null) given a plain value: what else it takes and the value
    (`` or null, got true``); None for any other problem."""
    subtypes, given = re.search(r"Subtypes: \[(.*?)\]", inner), re.search(r"Given value: (.*)$", inner)
    if "Expected a dot import path string" not in inner or subtypes is None or given is None:
        return None
    if any(_is_dataclass_path(path) for path in re.findall(r"<class '([\w.]+)'>", subtypes[1])):
        return f"{' or null' if 'NoneType' in subtypes[1] else ''}, got {given[1]}"
    return None


def _is_dataclass_path(path: str) -> bool | None:
    """Whether the class at dotted ``path`` is a dataclass; None where it cannot be imported."""
    module, _, name = path.rpartition(".")
    try:
        return dataclasses.is_dataclass(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError):
        return None


def _given_by_class_path(text: str) -> bool:
    """Whether jsonargparse's problem is with a class a recipe gives as ``class_path`` and ``init_args`` (an engine),
    not with a block typed by a dataclass (``model.lora``), whose keys are written directly."""
    named = re.search(r"given class_path '([\w.]+)'", text)
    if named is None:
        return "class_path" in text
    return _is_dataclass_path(named[1]) is not True


def keyed(error: UserError, model_class: type, datamodule_class: type) -> UserError:
    """``error`` with its key read from the recipe's top: a key the module or datamodule raised about one of its own
    arguments (``learning_rate``) gets its block in front (``model.learning_rate``)."""
    name = re.match(r"\w+", error.key or "")
    for block, cls in (("model", model_class), ("data", datamodule_class)):
        if name and name[0] in inspect.signature(cls).parameters:
            return error.within(block)
    return error


def _cli(recipe: str | None, overrides: list[str], build: bool, sized_only: bool = False) -> RecipeCLI:
    """The parsed (and, with ``build``, built) run of a recipe file and command-line overrides, or of the command
    line alone (``recipe`` None: ``--task`` names the task)."""
    overrides = _with_overlays_spelled_out(overrides)
    task = read_task(None if recipe is None else Path(recipe), overrides)
    model_class, datamodule_class = task_classes(task)
    if task == "grpo":  # GRPO's data file was data.path; a command line may still say so, and override the recipe's
        for i, arg in enumerate(overrides):
            if arg.partition("=")[0] == "--data.path":
                print("note: data.path is the earlier name of data.train_data; write data.train_data", file=sys.stderr)
                overrides = [*overrides[:i], arg.replace("--data.path", "--data.train_data", 1), *overrides[i + 1 :]]
    try:
        with warnings.catch_warnings():
            # The recipe goes in as `args` on purpose; LightningCLI warns when sys.argv is also set.
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
            # In a context of its own: jsonargparse leaves its parser in a context variable it sets while parsing, and
            # the parser holds the run (its model, trainer and process groups), which would then live until the
            # interpreter's exit, where gloo's threads freeing them can abort the process (cli.py frees them before).
            return contextvars.copy_context().run(
                RecipeCLI,
                model_class,
                datamodule_class,
                build=build,
                sized_only=sized_only,
                recipe=recipe,
                overrides=overrides,
                run=False,
                args=[*(["--config", recipe] if recipe is not None else []), *overrides],
                save_config_callback=SaveRecipe,
                parser_kwargs={"exit_on_error": False, "prog": "lightning-rl run", "allow_abbrev": False, "description": DESCRIPTION},
                auto_configure_optimizers=False,
                # Packed rows are dealt to ranks by the datamodule's own sampler.
                trainer_defaults={"use_distributed_sampler": False},
            )
    except ArgumentError as e:
        message = _one_line(e)
        if re.fullmatch(r"model\.scale_rewards must be one of .*, got (?i:true|false)", message):  # TRL's booleans
            message += " (TRL's True is group, its False none)"
        if trl_packing := re.fullmatch(r"data\.packing must be one of .*, got (?i:(true|bfd)|(false)|(wrapped))", message):  # TRL's values
            message += (" (TRL's packing: true, bfd, is flat: whole examples packed, each attending to itself; tree also forwards a "
                        "shared prefix once, and auto picks)" if trl_packing[1] else " (TRL's packing: false is none)" if trl_packing[2] else
                        " (TRL's wrapped cuts examples across rows, which no layout here does: flat packs whole examples)")  # fmt: skip
        if message.startswith("model.engine must be one of"):
            short, got = message.removeprefix("model.engine must be one of ").split(", got ", 1)
            if got.isidentifier():
                near = (_unknown_engine(got) or "").partition(" (did you mean ")[2]
                message = f"model.engine must be one of {short} or an engine's class_path, got {got}{f' (did you mean {near}' if near else ''}"
            elif (problem := _unknown_engine((engine := _engine_name(recipe, overrides))[1])) is not None:
                message = f"model.engine.class_path: {problem}"
            elif engine[0]:
                message = (f"model.engine: a short name ({short}) takes no options; with options give the engine's class_path "
                           "(its class name, e.g. VLLMEngine, or pkg.module.Class) and init_args")  # fmt: skip
            else:
                message = ("model.engine: init_args given without a class_path: name the engine beside them with class_path "
                           "(its class name, e.g. HFRolloutEngine or VLLMEngine, or pkg.module.Class)")  # fmt: skip
        elif nested := re.fullmatch(r"trainer\.strategy must be .*, got NestedArg\(key='([\w.]+)', val='(.*)'\)", message):
            message = _strategy_options(nested[1], nested[2])
        key = re.match(r"(?:unknown key ')?([\w.]+)", message)
        blamed = recipe is None or (key is not None and _written_on_command_line(key[1], overrides))
        laid = [path for path in overlays(overrides) if key is not None and _written_in(key[1], path)]
        raise RecipeError(f"{'command line' if blamed else laid[-1] if laid else recipe}: {message}") from None
    except UserError as error:
        raise keyed(error, model_class, datamodule_class) from None


def _strategy_options(option: str, value: str) -> str:
    """A strategy given by its registered name (``cpu_static``) and an option: a name takes none, its class does."""
    from lightning.pytorch.strategies import StrategyRegistry

    ours = ", ".join(f"{name}: {entry['strategy'].__name__}" for name, entry in StrategyRegistry.items()
                     if entry["strategy"].__module__.startswith("lightning_rl."))
    return (f"trainer.strategy: a strategy given by its registered name takes no options ({option}={value}): name its class "
            f"({ours}; Lightning's, e.g. DDPStrategy), then its options: --trainer.strategy=CLASS --trainer.strategy.{option}={value}")


def _engine_name(recipe: str | None, overrides: list[str]) -> tuple[bool, str | None]:
    """(whether the recipe or a later override names the engine, the name or class_path it gives where readable)."""
    model = (yaml.safe_load(Path(recipe).read_text()) or {}).get("model") if recipe is not None else None
    engine = model.get("engine") if isinstance(model, dict) else None
    named = isinstance(engine, str) or (isinstance(engine, dict) and "class_path" in engine)
    name = engine if isinstance(engine, str) else str(engine["class_path"]) if named else None
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key == "--model.engine":
            named = not value.lstrip().startswith("{") or "class_path" in value
            name = value.strip() if named and not value.lstrip().startswith("{") else None
        elif key == "--model.engine.class_path":
            named, name = True, value.strip()
    return named, name


def _engine_options(name: str | None) -> list[str] | None:
    """The options an engine's ``init_args`` take (its class's own, less the model path and seed the run gives); None
    where that cannot be said: no engine named, one that does not resolve (said elsewhere), or one taking any keyword."""
    try:
        parameters = list(inspect.signature(EngineSpec.of(name).engine_class).parameters.values()) if name else None
    except Exception:  # an engine that does not resolve, or whose module fails to import: said where the engine is built
        return None
    if parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _keys_with_lines(node: yaml.Node | None) -> list[tuple[str, int]]:
    return [(str(k.value), k.start_mark.line + 1) for k, _ in node.value if isinstance(k, yaml.ScalarNode)] if isinstance(node, yaml.MappingNode) else []


def _unknown_engine(name: str | None) -> str | None:
    """What is wrong with an engine's name or class_path (None: it names an engine class), with the nearest engine."""
    if name is None:
        return None
    try:
        EngineSpec.of(name)
    except ValueError as error:
        paths = {path.replace(":", ".").rpartition(".")[2]: path for path in SHORT_NAMES.values()}
        last = name.replace(":", ".").rpartition(".")[2]
        near = [last] if last in paths else difflib.get_close_matches(last, list(paths), n=1, cutoff=0.6)
        return f"{error}{f' (did you mean {paths[near[0]]}?)' if near else ''}"
    return None


def build(recipe: str | None, overrides: list[str]) -> RecipeCLI:
    """The run a recipe describes: its module, datamodule and trainer (``.model``, ``.datamodule``, ``.trainer``).
    Reward and tool modules are imported from the recipe's folder and the working directory too."""
    quiet_third_party_noise()
    _import_from(recipe)
    return _cli(recipe, overrides, build=True)


def _import_from(recipe: str | None) -> None:
    """Reward and tool modules are imported from the recipe's folder and the working directory too."""
    folders = {Path(recipe).parent: "the recipe's folder"} if recipe is not None else {}
    dotted.set_import_folders({**folders, Path.cwd(): "the working directory"})


def parse(recipe: str, overrides: list[str], sized_only: bool = False) -> dict[str, Any]:
    """The recipe as ``run`` reads it, ``overrides`` applied, once it passed every check of ``build`` that needs
    nothing built (keys, types, choices, the Trainer's values, the module's values; ``sized_only``: all but the run's
    length): a plain nested dict of the values the user wrote, in the recipe or an override (the defaults left out, so
    a launch can tell "not said" from a value). Reward and tool modules are imported as ``build`` imports them."""
    _import_from(recipe)
    overrides = _with_overlays_spelled_out(overrides)
    config = _cli(recipe, overrides, build=False, sized_only=sized_only).config.as_dict()
    written = yaml.safe_load(Path(recipe).read_text())
    for overlay in overlays(overrides):  # a file laid over the recipe writes its keys
        for dotted_key, value in _dotted_items(yaml.safe_load(overlay.read_text()) or {}):
            _place(written, dotted_key).setdefault(dotted_key.rpartition(".")[2], {} if isinstance(value, dict) else True)
    for override in overrides:  # `--a.b=value`: a.b is written
        if not override.startswith("--config="):
            dotted_key = override.lstrip("-").split("=", 1)[0].rstrip("+")
            _place(written, dotted_key)[dotted_key.rpartition(".")[2]] = True
    return _written(config, written)


def _place(written: dict[str, Any], dotted_key: str) -> dict[str, Any]:
    """The mapping of ``written`` that holds ``dotted_key``'s last part, made where missing (a value where a mapping
    would be: a mapping of its own, not kept)."""
    node = written
    for part in dotted_key.split(".")[:-1]:
        node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else {}
    return node


def _written(parsed: Any, written: Any) -> Any:
    """The part of ``parsed`` whose keys appear in ``written``; a class's arguments may be written beside its
    ``class_path`` rather than under ``init_args``."""
    if not isinstance(parsed, dict) or not isinstance(written, dict):
        return parsed
    if "init_args" in parsed and "init_args" not in written:
        written = {**written, "init_args": {key: value for key, value in written.items() if key != "class_path"}}
    elif "init_args" not in parsed and isinstance(written.get("init_args"), dict):  # a dataclass by class_path: parsed as its fields
        written = {**{key: value for key, value in written.items() if key not in ("class_path", "init_args")}, **written["init_args"]}
    return {key: _written(parsed[key], written[key]) for key in parsed if key in written}
