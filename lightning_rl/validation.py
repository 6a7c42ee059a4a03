"""Checks of recipe values that their types do not say: bounds, finiteness, known names, no duplicates.

The modules and datamodules run them in ``__init__``, so a bad value is refused as the recipe is read, before
anything loads or is written. Each raises a ``RecipeError`` whose message starts with the key it is given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from lightning_rl.errors import RecipeError


# The trainer.precision values every backend runs (README), and Lightning's short names of them.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def precision(value: Any) -> str:
    """``trainer.precision`` as one of ``PRECISIONS`` (a short name read as Lightning reads it); refused otherwise."""
    name = _PRECISION_ALIASES.get(str(value), str(value))
    if name not in PRECISIONS:
        raise RecipeError(f"trainer.precision must be one of {', '.join(PRECISIONS)}, got {value!r}", "trainer.precision")
    return name


def devices(value: Any, key: str = "trainer.devices") -> int | list[int] | None:
    """``trainer.devices`` as Lightning reads it: None for every device (``auto``, -1, ``"-1"``), a count (``2`` or
    ``"2"``), or the devices' indices (``[0, 2]`` or ``"0,2"``); refused otherwise (Lightning ends in a traceback)."""
    if value is None or value in ("auto", -1, "-1"):
        return None
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",") if part.strip()]
        if value.strip().isdigit():
            value = int(value)
        elif parts and all(part.isdigit() for part in parts):
            value = [int(part) for part in parts]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        return list(value)
    raise RecipeError(f"{key} must be auto, -1 (every device), a count >= 1 or a list of device indices, got {value!r}", key)


def resolved_against(path: str | os.PathLike) -> str:
    """What a path that was not found was looked for from, for its message: a relative one is read from the working
    directory (not the recipe's folder)."""
    return "" if os.path.isabs(path) else f" (a relative path, read from the working directory {os.getcwd()})"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{key} must be >= 1, got {value!r}", key)
    return value


def non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecipeError(f"{key} must be >= 0, got {value!r}", key)
    return value


def finite_positive(key: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise RecipeError(f"{key} must be a finite number > 0, got {value!r}", key)
    if value <= 0:
        raise RecipeError(f"{key} must be > 0, got {value!r}", key)
    return value


def finite_non_negative(key: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise RecipeError(f"{key} must be a finite number >= 0, got {value!r}", key)
    if value < 0:
        raise RecipeError(f"{key} must be >= 0, got {value!r}", key)
    return value


def fraction(key: str, value: Any, *, low_open: bool = False, high_open: bool = True) -> float:
    """A number in [0, 1), or (0, 1] etc. as the open ends say."""
    ok = _is_number(value) and math.isfinite(value)
    ok = ok and (value > 0 if low_open else value >= 0) and (value < 1 if high_open else value <= 1)
    if not ok:
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise RecipeError(f"{key} must be in {interval}, got {value!r}", key)
    return value


def one_of(key: str, value: Any, names: Iterable[Any]) -> Any:
    names = list(names)
    # A flag is none of the names (True == 1), unless the names are flags too.
    if value not in names or (isinstance(value, bool) and not any(isinstance(name, bool) for name in names)):
        trl = " (TRL's True is group, its False none)" if key.rpartition(".")[2] == "scale_rewards" and isinstance(value, bool) else ""
        raise RecipeError(f"{key} must be one of {', '.join(map(str, names))}, got {value!r}{trl}", key)
    return value


def _literal_choices(hint: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` annotation (optionally with None) allows; None for any other annotation."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [_literal_choices(arg) if arg is not type(None) else (None,) for arg in typing.get_args(hint)]
        return None if any(m is None for m in members) else tuple(v for m in members for v in m)
    return None


def literal_arguments(function: Callable[..., Any], values: Mapping[str, Any]) -> None:
    """Each argument of ``function`` annotated with a set of names (``Literal``) holds one of them: what the recipe's
    parser refuses is refused from Python alike (a misspelt name there was taken as the default, or failed mid-run)."""
    for key, hint in typing.get_type_hints(function).items():
        if key in values and (choices := _literal_choices(hint)) is not None:
            one_of(key, values[key], choices)


def unique(key: str, values: Sequence[Any]) -> Sequence[Any]:
    repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
    if repeated:
        raise RecipeError(f"{key} must not repeat a name, got {', '.join(repeated)} more than once", key)
    return values


T = TypeVar("T")


def settings_group(cls: type[T], value: T | dict[str, Any] | None, key: str) -> T:
    """A recipe group (``loss:``, ``sampling:``) as its dataclass, which checks its own values (LightningCLI may
    hand the group over as a mapping); a key the dataclass lacks is refused."""
    if isinstance(value, cls):
        return value
    values = dict(value or {})
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise RecipeError(f"{key}.{unknown[0]}: not a {key} option (see {cls.__name__})", f"{key}.{unknown[0]}")
    return cls(**values)
