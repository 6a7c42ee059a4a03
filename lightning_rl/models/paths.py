"""Where a recipe's ``model_name_or_path`` points."""

from __future__ import annotations

from lightning_rl.toy.model import TINY_NAME, tiny_model_path


def resolve_model_path(name_or_path: str) -> str:
    """A from_pretrained folder or hub id, as given; ``tiny``, the embedded default, is built once and cached."""
    return str(tiny_model_path()) if name_or_path == TINY_NAME else name_or_path
