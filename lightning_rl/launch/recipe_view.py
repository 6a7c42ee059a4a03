"""Read-only view of the recipe fields a launch needs, addressed by dotted keys: the recipe as ``lightning-rl run``
reads it (``lightning_rl/recipe.py``: the same parser, checks and overrides), holding what the user gave."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rl.errors import RecipeError
from lightning_rl.recipe import parse, resolve_strategy, task_classes


class LaunchError(RecipeError):
    """A launch request that cannot run; the message names the flag or recipe key at fault."""


class FlagParser(argparse.ArgumentParser):
    """argparse whose mistakes are a ``LaunchError`` (one ``error:`` line, exit 2) rather than its usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise LaunchError(message)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """A launch command's own flags, and the ``lightning-rl run`` overrides after ``--`` that it passes on."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], tuple(argv[cut + 1 :])
    return argv, ()


_MISSING = object()
MODEL_KEY = "model.model_name_or_path"


@dataclass(frozen=True)
class RecipeView:
    path: Path
    data: dict[str, Any]

    @classmethod
    def parse(cls, path: str | Path, overrides: Sequence[str] = (), sized_only: bool = False) -> RecipeView:
        """The recipe at ``path`` with the ``run`` overrides a launch passes on applied, refused as ``run`` would
        refuse it (an unknown key, a wrong type, a bad choice; ``sized_only``, for a plan: all but a run without end)."""
        return cls(Path(path), parse(str(path), list(overrides), sized_only))

    def get(self, dotted_key: str, default: Any = None) -> Any:
        """Value at `a.b.c`; a strategy or module given as `{class_path, init_args}` is looked into too."""
        node: Any = self.data
        for part in dotted_key.split("."):
            if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
                node = node["init_args"]
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def require(self, dotted_key: str) -> Any:
        value = self.get(dotted_key, _MISSING)
        if value is _MISSING:
            raise LaunchError(f"{self.path}: missing key `{dotted_key}`")
        return value

    @property
    def task(self) -> str:
        task = self.require("task")
        if task not in ("sft", "grpo"):
            raise LaunchError(f"{self.path}: `task` must be sft or grpo, got {task!r}")
        return task

    def setting(self, dotted_key: str) -> Any:
        """A ``model.*`` or ``data.*`` argument as ``run`` reads it: the recipe's value, else the task's module or
        datamodule default (None where it has none)."""
        value = self.get(dotted_key, _MISSING)
        if value is not _MISSING:
            return value
        section, _, name = dotted_key.partition(".")
        model_class, data_class = task_classes(self.task)
        parameter = inspect.signature({"model": model_class, "data": data_class}[section]).parameters.get(name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    @property
    def strategy_class(self) -> type | None:
        """The Strategy class ``trainer.strategy`` names, as ``run`` resolves it; None for ``auto`` (Lightning's choice)."""
        return resolve_strategy(self.get("trainer.strategy"))

    @property
    def model_id(self) -> str:
        """The model's hub id, local folder or embedded name, as ``run`` reads it: the module's default when the
        recipe does not say."""
        return str(self.setting(MODEL_KEY))
