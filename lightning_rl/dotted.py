"""The one loader of objects named by dotted path in a recipe (rewards, tools, engines, custom functions); a leaf."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load_object(path: str, what: str, aliases: Mapping[str, Any] | None = None) -> Any:
    """``aliases[path]`` if given, else the object at ``pkg.module:name`` or ``pkg.module.name``. Any failure to
    find it, a module that does not import or does not parse included, is one ``ValueError`` naming ``what``."""
    aliases = aliases or {}
    if path in aliases:
        return aliases[path]
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        if aliases:
            raise ValueError(f"{what} {path!r} is neither one of {', '.join(sorted(aliases))} nor a dotted path (pkg.module:name)")
        raise ValueError(f"{what} {path!r} is not a dotted path (pkg.module:name)")
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as error:
        raise ValueError(f"{what} {path!r}: {error.filename}:{error.lineno}: {error.msg}") from None
    except ImportError as error:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {error}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)
