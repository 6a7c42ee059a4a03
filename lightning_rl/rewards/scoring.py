"""Scoring rollouts with several weighted reward functions, sync or async, isolating failures."""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_rl.rewards.builtin import BUILTIN_REWARDS

log = logging.getLogger(__name__)

RewardFunction = Callable[..., Any]


def load_reward_function(path: str) -> RewardFunction:
    """A built-in by name (`math_answer`) or any callable by dotted path (`pkg.module:fn` or `pkg.module.fn`)."""
    if path in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[path]
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward function {path!r} is neither a built-in {sorted(BUILTIN_REWARDS)} nor a dotted path"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward function {path!r}: cannot import module {module_name!r}: {error}") from error
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"reward function {path!r}: module {module_name!r} has no callable {attr!r}")
    return function


@dataclass
class RewardSpec:
    """One reward function of a run: where it lives, its weight, fixed keyword arguments, its name."""

    function: str | RewardFunction
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str | None = None

    def as_config(self) -> dict[str, Any]:
        """The spec as plain data; a function given as an object is named by its dotted path."""
        function = self.function
        if not isinstance(function, str):
            function = f"{function.__module__}:{function.__qualname__}"
        return {"function": function, "weight": self.weight, "kwargs": dict(self.kwargs), "name": self.name}

    def resolve(self) -> tuple[str, RewardFunction]:
        function = load_reward_function(self.function) if isinstance(self.function, str) else self.function
        name = self.name or (self.function if isinstance(self.function, str) else function.__name__)
        name = name.rpartition(":")[2].rpartition(".")[2]
        return name, functools.partial(function, **self.kwargs) if self.kwargs else function


@dataclass
class RewardError:
    """A reward function that raised on one sample: logged, and the sample scores 0."""

    function: str
    sample: int
    prompt: str
    completion: str
    error: str


@dataclass
class Scores:
    """Rewards of N completions: weighted total [N], each function's raw score [N], failures."""

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    errors: list[RewardError]


class RewardScorer:
    """Calls every reward function on a batch and sums the weighted scores.

    A function that raises on the batch is retried sample by sample so that only the failing
    samples score 0 (or, with `on_error="raise"`, the error propagates).
    """

    def __init__(self, specs: Sequence[RewardSpec], on_error: Literal["zero", "raise"] = "zero") -> None:
        if not specs:
            raise ValueError("at least one reward function is needed")
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', got {on_error!r}")
        resolved = [spec.resolve() for spec in specs]
        names = [name for name, _ in resolved]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique (set `name:`), got {names}")
        self.functions = dict(resolved)
        self.weights = {name: float(spec.weight) for (name, _), spec in zip(resolved, specs, strict=True)}
        self.on_error = on_error

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence[Any]]
    ) -> Scores:
        return asyncio.run(self._score(list(prompts), list(completions), dict(columns)))

    async def _score(self, prompts: list[str], completions: list[str], columns: dict[str, Sequence[Any]]) -> Scores:
        errors: list[RewardError] = []
        results = await asyncio.gather(
            *(self._score_one(name, fn, prompts, completions, columns, errors) for name, fn in self.functions.items())
        )
        per_function = dict(zip(self.functions, results, strict=True))
        total = torch.zeros(len(completions), dtype=torch.float32)
        for name, values in per_function.items():
            total += self.weights[name] * values
        return Scores(total=total, per_function=per_function, errors=errors)

    async def _score_one(
        self,
        name: str,
        fn: RewardFunction,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, Sequence[Any]],
        errors: list[RewardError],
    ) -> torch.Tensor:
        try:
            return await _call(fn, prompts, completions, columns)
        except Exception:
            if self.on_error == "raise":
                raise
        values = torch.zeros(len(completions), dtype=torch.float32)
        for i in range(len(completions)):
            one_columns = {key: [column[i]] for key, column in columns.items()}
            try:
                values[i] = (await _call(fn, [prompts[i]], [completions[i]], one_columns))[0]
            except Exception as error:  # a broken reward must not end the run: the sample scores 0
                message = f"{type(error).__name__}: {error}"
                log.warning("reward %r failed on sample %d (%r): %s", name, i, completions[i][:200], message)
                errors.append(RewardError(name, i, prompts[i], completions[i], message))
        return values


async def _call(
    fn: RewardFunction, prompts: list[str], completions: list[str], columns: dict[str, Sequence[Any]]
) -> torch.Tensor:
    result = fn(prompts=prompts, completions=completions, **columns)
    if inspect.isawaitable(result):
        result = await result
    values = [float(v) for v in result]
    if len(values) != len(completions):
        raise ValueError(f"returned {len(values)} scores for {len(completions)} completions")
    if any(math.isnan(v) for v in values):
        raise ValueError("returned NaN")
    return torch.tensor(values, dtype=torch.float32)
