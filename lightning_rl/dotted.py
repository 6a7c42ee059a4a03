"""The one loader of objects named by dotted path in a recipe (rewards, tools, engines, custom functions); a leaf."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The folders the run put on the import path for the recipe's own modules, with what they are (named when one fails).
IMPORT_FOLDERS: dict[str, str] = {}
_ADDED: list[str] = []  # those of them this module appended to sys.path (one already there is left to its owner)


def set_import_folders(folders: dict[Path, str]) -> None:
    """Let recipes name modules in ``folders`` (the recipe's folder, the working directory: folder -> what it is): put
    them on the import path, after any already there, so a module of the recipe's never hides an installed one. The
    folders an earlier recipe of this process put there are taken off first: a run's modules come from its own."""
    for name in _ADDED:
        if name in sys.path:
            sys.path.remove(name)
    _ADDED.clear()
    IMPORT_FOLDERS.clear()
    for folder, what in folders.items():
        name = str(Path(folder).resolve())
        IMPORT_FOLDERS.setdefault(name, what)
        if name not in sys.path:
            sys.path.append(name)
            _ADDED.append(name)


def load_object(path: str, what: str, aliases: Mapping[str, Any] | None = None) -> Any:
    """``aliases[path]`` if given, else the object at ``pkg.module:name`` or ``pkg.module.name``. Any failure to
    find it, a module that does not import or does not parse included, is one ``ValueError`` naming ``what``; a
    module that is nowhere names the folders searched."""
    aliases = aliases or {}
    if path in aliases:
        return aliases[path]
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    file, _, name = path.partition(":")
    if file.endswith(".py") and any(Path(folder, file).is_file() for folder in [*IMPORT_FOLDERS, "."]):  # a file's name where its module's goes
        module = file.removesuffix(".py").replace("/", ".").strip(".")
        raise ValueError(f"{what} {path!r} names a file; name its module, without .py: {module}:{name or 'NAME'}")
    if "/" in path and ":" not in path:  # a hub id or a folder (TRL takes a reward model's there)
        raise ValueError(f"{what} {path!r} is a path, not a dotted path (pkg.module:name); a reward model is "
                         f"`function: reward_model` with `kwargs: {{path: {path}}}`" if what == "reward function" else
                         f"{what} {path!r} is a path, not a dotted path (pkg.module:name)")
    if not sep or not module_name or not attr:
        if aliases:
            raise ValueError(f"{what} {path!r} is neither one of {', '.join(sorted(aliases))} nor a dotted path (pkg.module:name)")
        raise ValueError(f"{what} {path!r} is not a dotted path (pkg.module:name)")
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as error:
        raise ValueError(f"{what} {path!r}: {error.filename}:{error.lineno}: {error.msg}") from None
    except ModuleNotFoundError as error:
        if error.name is not None and f"{module_name}.".startswith(f"{error.name}."):  # the module (or its package) is nowhere
            raise ValueError(f"{what} {path!r}: no module {error.name!r} in {_searched()}") from None
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {error}") from None
    except ImportError as error:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {error}") from None
    except Exception as error:  # the module's own code failed as it ran (a missing environment variable, ...)
        raise ValueError(f"{what} {path!r}: importing {module_name!r} raised {type(error).__name__}: {error}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}{_hidden(module)}")
    return getattr(module, attr)


def _hidden(module: Any) -> str:
    """Why a module of the recipe's may not be the one imported: an installed module of its name comes first (the
    import path puts the recipe's folders last), and a file beside the recipe named so is never read."""
    top = module.__name__.partition(".")[0]
    origin = getattr(sys.modules.get(top, module), "__file__", None)
    imported = Path(origin).resolve() if origin else None
    for folder, what in IMPORT_FOLDERS.items():
        mine = [f.resolve() for f in (Path(folder, f"{top}.py"), Path(folder, top, "__init__.py")) if f.is_file()]
        if mine and imported not in mine:
            return (f" ({top} in {what} {folder} is hidden by the module of that name imported from "
                    f"{origin or 'the built-in modules'}, which comes first: rename your file)")
    return ""


def _searched() -> str:
    folders = [f"{what} {folder}" for folder, what in IMPORT_FOLDERS.items()]
    return ", ".join([*folders, "the installed packages"]) + " (a module of your own goes beside the recipe or in the working directory)"
