"""A script of ``benchmarks/`` loaded as a module, for tests that reuse what it measures."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from support.paths import REPO


def load_benchmark(name: str) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]
