"""Read-only view of the recipe fields a launch needs, addressed by dotted keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class LaunchError(ValueError):
    """A launch request that cannot run; the message names the flag or recipe key at fault."""


_MISSING = object()
MODEL_KEY = "model.model_name_or_path"


@dataclass(frozen=True)
class RecipeView:
    path: Path
    data: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> RecipeView:
        path = Path(path)
        if not path.is_file():
            raise LaunchError(f"{path}: recipe file not found")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise LaunchError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(data, dict):
            raise LaunchError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
        return cls(path, data)

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

    @property
    def model_id(self) -> str:
        """The model's hub id or local folder."""
        return str(self.require(MODEL_KEY))
