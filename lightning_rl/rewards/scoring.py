"""Scoring rollouts with several weighted reward functions, sync or async, isolating failures.

A reward function is called by keyword with those of the batch's arguments it names, as TRL's `GRPOTrainer` calls
it (`arguments.py`): `prompts` and `completions` (strings, or message lists for conversational prompts),
`trainer_state`, `log_extra`, `log_metric`, every column of the prompt records, and what the trainer adds
(`tool_calls`, `transcripts`, `completion_ids`, `prompt_messages`); a function with `**kwargs` gets them all. Its fixed
`kwargs` come from the recipe. A function may return None for a sample it does not apply to: that sample is left out
of its mean and std and of the weighted sum, as in TRL; a sample no function applies to has no reward (NaN) and no
advantage.
Mistakes are refused before training: fixed kwargs the function does not take, an argument it needs that
neither the data nor the trainer provides (`check_arguments`), and, for the built-ins, fixed kwargs
that do not work (they are called once on an empty batch, which compiles a regular expression).

A NaN is read as None, as TRL reads it. While training, a function that raises or returns an infinite score costs
only the samples it failed on (they score 0, are logged and counted); one that returns something else than a number (or None) per completion
stops the run at once (`RewardContractError`), as one that raises a `UserError` does (a mistake in the recipe, the
same for every sample: a reward model without a chat template given conversational prompts); one that fails on every
sample of a step stops the run
(`all_failed="stop"`), since training on all-zero rewards would silently train on nothing. A call that runs
past `timeout_s` fails the samples it was given (kind ``timeout``): a plain function runs on a daemon thread of
its own, left behind when it does not return (exiting never waits on it), a coroutine is cancelled. A plain function
that fails there for needing the main thread (``signal.alarm`` timeouts: math_verify's) is called on the main thread
from then on, where the step scores on it, as TRL calls it. Coroutines run
on an event loop of their own thread (kept for the process, as TRL keeps one), so one that blocks (``time.sleep``
inside ``async def``) still times out, where it would have frozen the loop that keeps the time (it holds the rewards'
loop, and the coroutines after it, until it returns). A stop signal
does not wait for a call that has not returned (one called on the main thread runs to its end first): the step is abandoned (``stopping.StepAbandoned``) and the run saves
the step before.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import math
import numbers
import re
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_rl.dotted import load_object
from lightning_rl.errors import RecipeError, UserError
from lightning_rl.rewards.arguments import RewardBatch, RewardLogs, TrainerState, reads_text
from lightning_rl.rewards.builtin import BUILTIN_REWARDS
from lightning_rl.stopping import POLL_S, StepAbandoned, abandon_if_stopping

log = logging.getLogger(__name__)

RewardFunction = Callable[..., Any]

BATCH_ARGUMENTS = ("prompts", "completions", "trainer_state", "log_extra", "log_metric")
"""What every reward function may ask for, whatever the data; the caller's columns come on top."""
# What reward functions get besides prompts, completions and the data's columns (the trainer's, per rollout).
ROLLOUT_COLUMNS = ("tool_calls", "transcripts", "completion_ids", "prompt_messages")
# The data's columns a reward function is not given, as TRL gives neither: the prompt (it gets `prompts`, as rendered)
# and a `completion` column (it gets the policy's `completions`).
NO_REWARD_COLUMNS = frozenset({"prompt", "completion"})


def load_reward_function(path: str) -> RewardFunction:
    """A built-in by name (`math_answer`) or any callable by dotted path (`pkg.module:fn` or `pkg.module.fn`)."""
    if any(mark in path for mark in ("<lambda>", "<locals>", "<partial")):  # a checkpoint's record of a function given as an object
        raise ValueError(f"reward function {path!r} was a lambda, a function defined inside another or a partial of positional arguments, which cannot be imported "
                         "again: give it as rewards= (load_from_checkpoint(..., rewards=[...])), or define it at a module's top level")
    try:
        function = load_object(path, "reward function", BUILTIN_REWARDS)
    except ValueError as error:
        if not path.startswith("__main__:"):
            raise
        # A checkpoint's record of a function the training script defined: another script has no such function.
        raise ValueError(f"{error}: it was defined in the script that trained (__main__); give it as rewards= "
                         "(load_from_checkpoint(..., rewards=[...])), or define it in a module both scripts import") from None
    if not callable(function):
        raise ValueError(f"reward function {path!r} is not callable")
    return function


# A fixed keyword argument's value, as the recipe wrote it: a string stays a string (typed Any, the recipe parser read
# a quoted '[0-9]' again as YAML, a list).
KwargValue = str | bool | int | float | list | dict | None


class _Abandoned(Exception):
    """``StepAbandoned`` carried out of the reward loop as an ordinary exception (see ``RewardScorer.score``)."""

    def __init__(self, stop: StepAbandoned) -> None:
        super().__init__(str(stop))
        self.stop = stop


@dataclass
class RewardSpec:
    """One reward function of a run: where it lives, its weight, fixed keyword arguments, its name.

    Args:
        function: a built-in reward's name or a dotted path (``pkg.module:name``).
        weight: its weight in the step's reward. TRL: `reward_weights` (one list for all).
        kwargs: keyword arguments every call gets.
        name: its name in the logs (default: the function's).
    """

    function: str | RewardFunction
    weight: float = 1.0
    kwargs: dict[str, KwargValue] = field(default_factory=dict)
    name: str | None = None

    def as_config(self) -> dict[str, Any]:
        """The spec as plain data; a function given as an object is named by its dotted path, a ``functools.partial``
        by its function's, with the keywords it binds among the kwargs (positional ones cannot be: it is then named as
        a function that cannot be imported again, which loading says)."""
        function, kwargs = self.function, dict(self.kwargs)
        if not isinstance(function, str):
            partials = []
            while isinstance(function, functools.partial):
                partials.append(function)
                function = function.func
            for partial in partials:  # the outer partial's keywords win, as calling it does
                kwargs = {**partial.keywords, **kwargs}
            function = f"{getattr(function, '__module__', None) or type(function).__module__}:{getattr(function, '__qualname__', None) or type(function).__qualname__}"
            if any(partial.args for partial in partials):
                function += ".<partial with positional arguments>"
        return {"function": function, "weight": self.weight, "kwargs": kwargs, "name": self.name}

    def resolve(self) -> tuple[str, RewardFunction]:
        """Its name (``name`` as given, else the function's: a path's last part, a partial's function's, an object's
        class's) and the function itself (without the fixed kwargs)."""
        function = load_reward_function(self.function) if isinstance(self.function, str) else self.function
        if self.name:
            return self.name, function
        if isinstance(self.function, str):
            return self.function.rpartition(":")[2].rpartition(".")[2], function
        inner = _unwrapped(function)
        return getattr(inner, "__name__", None) or type(inner).__name__, function


def _factory_kind(function: Any, kwargs: Mapping[str, Any]) -> str | None:
    """How ``function`` reads as a factory of the reward rather than the reward: ``named`` when every argument it
    takes by keyword is in ``kwargs``; ``defaults`` when the others have defaults and none is an argument a reward is
    called with (TRL's ``get_repetition_penalty_reward()``); None for a reward (or a ``**kwargs`` function)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    parameters = signature.parameters.values()
    if any(p.kind in (p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in parameters) or any(
            inspect.iscoroutinefunction(f) for f in (function, getattr(function, "__call__", None))):
        return None
    named = [p for p in parameters if p.kind is not p.VAR_POSITIONAL]
    if not named or set(kwargs) & {*BATCH_ARGUMENTS, *ROLLOUT_COLUMNS}:
        return None
    if {p.name for p in named} <= set(kwargs):
        return "named"
    rest = [p for p in named if p.name not in kwargs]
    returns = signature.return_annotation
    # A reward annotated to return its scores is one; TRL's factories say they return a Callable.
    said = returns is signature.empty or "Callable" in str(returns) or "callable" in str(returns)
    if said and all(p.default is not p.empty and p.name not in {*BATCH_ARGUMENTS, *ROLLOUT_COLUMNS} for p in rest):
        return "defaults"
    return None


def _unwrapped(function: Any) -> Any:
    """The function a ``functools.partial`` (of a partial ...) calls; anything else as it is."""
    while isinstance(function, functools.partial):
        function = function.func
    return function


class _Reward:
    """A resolved reward: the function, its weight and fixed kwargs, and which arguments it takes."""

    def __init__(self, spec: RewardSpec) -> None:
        self.name, self.function = spec.resolve()
        if isinstance(self.function, torch.nn.Module):  # TRL's reward_funcs take a model object; a call here cannot feed it
            where = getattr(self.function, "name_or_path", "") or "ITS_FOLDER"
            raise ValueError(f"reward {self.name!r} is a model object, not a reward function; a reward model is "
                             f"`function: reward_model` with `kwargs: {{path: {where}}}`")
        self.weight = float(spec.weight)
        self.kwargs = dict(spec.kwargs)
        self.on_main_thread = False  # a plain function that failed on a thread of its own for needing the main one
        self.on_main_thread_why = ""  # the first line of that failure
        if inspect.isclass(self.function):  # a reward with state (a reward model): built once from its kwargs
            try:
                self.function = self.function(**self.kwargs)
            except Exception as error:  # its own code failed (a missing key, a service not reached, ...)
                raise ValueError(f"reward {self.name!r}: cannot be built from kwargs {self.kwargs}: {type(error).__name__}: {error}") from None
            self.kwargs = {}
        if (kind := _factory_kind(self.function, self.kwargs)) is not None:
            self._make_from_factory(spec, kind)
        if not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {spec.weight}")
        try:
            parameters = inspect.signature(self.function).parameters.values()
        except (TypeError, ValueError):  # no readable signature (a C function): it gets every argument
            parameters = []
            self.takes_any = True
        else:
            self.takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
        self.text = reads_text(parameters)
        for p in parameters:
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise ValueError(f"reward {self.name!r}: parameter {p.name!r} is positional-only; rewards are called by keyword")
        by_keyword = (p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        self.accepted = {p.name: p.default is p.empty for p in by_keyword}  # name -> required
        for key in self.kwargs:
            if key in BATCH_ARGUMENTS:
                raise ValueError(f"reward {self.name!r}: kwarg {key!r} would replace the batch's {key}")
            if key not in self.accepted and not self.takes_any:
                raise ValueError(
                    f"reward {self.name!r}: unknown kwarg {key!r} (it takes "
                    f"{', '.join(n for n in self.accepted if n not in BATCH_ARGUMENTS) or 'none'})"
                )
        if self.function in BUILTIN_REWARDS.values():  # cheap and total on an empty batch: try the kwargs now
            try:
                self.function(**{**{name: [] for name, required in self.accepted.items() if required}, **self.kwargs})
            except Exception as error:
                raise ValueError(f"reward {self.name!r}: kwargs {self.kwargs} do not work: {type(error).__name__}: {error}") from None

    def _make_from_factory(self, spec: RewardSpec, kind: str) -> None:
        """A function that takes nothing but its kwargs sees no completion: a factory (TRL's
        ``get_soft_overlong_punishment``, written ``get_...(max_completion_len=..., ...)`` in TRL's scripts) that
        returns the reward, which replaces it here (named as TRL names it, after the reward it returns). One whose
        other arguments have defaults (``kind`` ``defaults``) is a factory where calling it so returns a function;
        else it stays the reward (a function of data columns with defaults, say)."""
        given = ", ".join(self.kwargs)
        takes = f"takes nothing but its kwargs ({given})" if kind == "named" else "takes no argument a reward is called with (the rest have defaults)"
        try:
            made = self.function(**self.kwargs)
        except Exception as error:
            if kind == "defaults" and not self.kwargs:  # maybe a reward of defaulted data columns, called without them
                return
            raise ValueError(f"reward {self.name!r} {takes}, so it is read as a factory of the reward, and calling it with its "
                             f"kwargs ({given}) failed: {type(error).__name__}: {error}") from None
        if kind == "defaults" and (not callable(made) or inspect.isclass(made)):
            return
        if not callable(made):
            raise ValueError(f"reward {self.name!r} takes nothing but its kwargs ({given}), so it cannot see a completion; a reward "
                             f"takes `completions` (or `prompts`, `completion_ids`, a data column), or a factory returns such a function")
        self.function, self.kwargs = made, {}
        if not spec.name:
            self.name = getattr(_unwrapped(made), "__name__", None) or self.name

    def check_arguments(self, available: Iterable[str]) -> None:
        available = set(available) | set(BATCH_ARGUMENTS)
        for key in self.kwargs:
            if key in available:
                raise ValueError(f"reward {self.name!r}: kwarg {key!r} is also a data column; rename one of them")
        missing = [n for n, required in self.accepted.items() if required and n not in self.kwargs and n not in available]
        if withheld := [n for n in missing if n in NO_REWARD_COLUMNS]:
            raise ValueError(f"reward {self.name!r} needs {withheld[0]!r}: a data column of that name is not given to rewards, as TRL "
                             f"gives none (they get `prompts` and the policy's `completions`); read another column")
        if missing:
            raise ValueError(
                f"reward {self.name!r} needs {', '.join(map(repr, missing))}, which is neither a data column nor a "
                f"reward argument (there are: {', '.join(sorted(available))})"
            )

    async def __call__(
        self, batch: RewardBatch, shared: Mapping[str, Any], timeout_s: float | None = None,
        one_at_a_time: asyncio.Lock | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Its scores of the batch (NaN where it returned None) and where it applies (did not return None)."""
        arguments = {**batch.arguments(self.text), **shared}
        if not self.takes_any:
            arguments = {key: value for key, value in arguments.items() if key in self.accepted}
        arguments.update(self.kwargs)
        what = f"reward {self.name!r}"
        try:
            if inspect.iscoroutinefunction(self.function):
                result = await _within(_on_reward_loop(self.function(**arguments)), timeout_s, what)
            else:  # plain functions one at a time, as if called in turn (a shared tokenizer is not thread-safe)
                async with one_at_a_time or asyncio.Lock():
                    result = await self._plain(arguments, timeout_s, what)
                if inspect.isawaitable(result):  # an object whose __call__ is async
                    result = await _within(_on_reward_loop(result) if asyncio.iscoroutine(result) else result, timeout_s, what)
        except TimeoutError:
            raise RewardTimeout(f"did not return within {timeout_s:g}s (reward_timeout_s)") from None
        # None, or NaN (TRL reads None as NaN, and a NaN as a sample the function does not apply to): left out.
        values = [math.nan if v is None else _as_float(v) for v in _scores_of(result, len(batch), what)]
        return torch.tensor(values, dtype=torch.float32), torch.tensor([not math.isnan(v) for v in values], dtype=torch.bool)

    async def _plain(self, arguments: dict[str, Any], timeout_s: float | None, what: str) -> Any:
        """A plain function's result: called on a thread of its own, which ``timeout_s`` can leave behind; on the main
        thread, as TRL calls it, once it failed on its own for needing the main one (math_verify's ``signal.alarm``
        timeouts)."""
        here = threading.current_thread() is threading.main_thread()
        if self.on_main_thread and here:
            return self.function(**arguments)
        try:
            if self.on_main_thread:  # scored off the main thread after all: refused below, as a first failure is
                raise ValueError(self.on_main_thread_why)
            return await _within(_on_thread(self.function, arguments, self.name), timeout_s, what)
        except Exception as error:
            if not _NEEDS_MAIN_THREAD.search(str(error)):
                raise
            said = f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"
            if not here:
                raise RewardContractError(
                    f"{what} needs the main thread ({said}), and rewards are scored off it here (async_mode scores on "
                    "the rollout thread): set async_mode: false, or make the reward run on any thread (math_verify: "
                    "parse(..., parsing_timeout=None), verify(..., timeout_seconds=None))") from None
            result = self.function(**arguments)  # raises as it would have on its thread: not the main thread's want
            log.warning("%s needs the main thread (%s): it is called there from now on, as TRL calls it, where "
                        "reward_timeout_s cannot cut a call that does not return", what, said)
            self.on_main_thread, self.on_main_thread_why = True, str(error).splitlines()[0][:400]
            return result


# What a function that runs only on the main thread raises elsewhere (signal.signal's ValueError, math_verify's).
_NEEDS_MAIN_THREAD = re.compile(r"signal only works in main thread|signal\.alarm")


class RewardContractError(UserError, ValueError):
    """A reward function that returned something other than one score (or None) per completion: a bug in it that a
    retry sample by sample would hide (one score for one sample is the right count), so the run stops on it."""

    key = "rewards"


def _as_float(score: Any) -> float:
    """A score as a float; an integer past float's range as the infinity it rounds to (a non-finite score, said as
    such), not an OverflowError read as the function having raised."""
    try:
        return float(score)
    except OverflowError:
        return math.inf if score > 0 else -math.inf


def _scores_of(result: Any, n: int, what: str) -> list[Any]:
    """``result`` as a list of ``n`` scores (numbers, bools, or None); a `RewardContractError` otherwise."""
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable) or getattr(result, "ndim", None) == 0:
        shown = f"a 0-d {type(result).__name__} (one number)" if getattr(result, "ndim", None) == 0 else f"a {type(result).__name__}"
        raise RewardContractError(f"{what} returned {shown}, not a list of one score per completion")
    scores = list(result)
    if len(scores) != n:
        raise RewardContractError(f"{what} returned {len(scores)} scores for {n} completions (one per completion, None where it does not apply)")
    for i, score in enumerate(scores):
        if score is not None and not isinstance(score, numbers.Real) and not (hasattr(score, "item") and getattr(score, "ndim", 1) == 0):
            raise RewardContractError(f"{what} returned {score!r} ({type(score).__name__}) for completion {i}, not a number or None")
    return scores


class RewardTimeout(TimeoutError):
    """A reward call that ran past its time limit."""


async def _within(awaitable: Any, timeout_s: float | None, what: str) -> Any:
    """The awaitable's result; a TimeoutError past ``timeout_s``, ``StepAbandoned`` as soon as the run is stopping
    (a stop signal does not wait for a reward that does not return)."""
    task = asyncio.ensure_future(awaitable)
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    awaited = False
    try:
        while True:
            abandon_if_stopping(what, awaited)
            left = POLL_S if deadline is None else min(POLL_S, deadline - loop.time())
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({task}, timeout=left)
            awaited = True
            if done:
                return task.result()
    finally:
        task.cancel()  # a coroutine given up on is cancelled; a thread's call is left behind (see the module doc)


_REWARD_LOOP: list[asyncio.AbstractEventLoop] = []  # the loop coroutine rewards run on, started on first use
_REWARD_LOOP_LOCK = threading.Lock()


def _on_reward_loop(coroutine: Any) -> asyncio.Future[Any]:
    """``coroutine`` run on the reward functions' own event loop (a daemon thread's); cancelling the returned future
    cancels it there."""
    with _REWARD_LOOP_LOCK:
        if not _REWARD_LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lightning-rl-async-rewards", daemon=True).start()
            _REWARD_LOOP.append(loop)
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, _REWARD_LOOP[0]))


def _on_thread(function: RewardFunction, arguments: dict[str, Any], name: str) -> asyncio.Future[Any]:
    """``function(**arguments)`` on a daemon thread of its own; the future gets its result or its exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def work() -> None:
        value, error = None, None
        # An event loop of the thread's own, as the main thread TRL calls rewards on has one for asyncio.get_event_loop()
        # (a sync reward running a coroutine with run_until_complete failed here for want of one).
        own_loop = asyncio.new_event_loop()
        asyncio.set_event_loop(own_loop)
        try:
            value = function(**arguments)
        except BaseException as caught:  # SystemExit included: it fails the samples, not the run
            error = caught
        finally:
            asyncio.set_event_loop(None)
            own_loop.close()
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the step gave up on this call (a timeout) and its loop is closed
            pass

    threading.Thread(target=work, name=f"reward {name}", daemon=True).start()
    return future


@dataclass
class RewardError:
    """A reward function that failed on one sample (`kind`: it ``raised``, returned a ``non_finite`` score, or
    its call hit the ``timeout``): logged, and the sample scores 0."""

    function: str
    sample: int
    prompt: str
    completion: str
    error: str
    kind: Literal["raised", "non_finite", "timeout"] = "raised"


class RewardFailedError(UserError, RuntimeError):
    """A reward function failed on every sample of a step (`RewardScorer(all_failed="stop")`)."""

    key = "rewards"

    def __init__(self, message: str, reward: str, step: int | None, first_error: str) -> None:
        super().__init__(message)
        self.reward, self.step, self.first_error = reward, step, first_error


def _raised(name: str, what: str) -> RewardFailedError:
    """The error that ends a step under ``reward_on_error: raise``: one line naming the reward and what it did."""
    return RewardFailedError(f"reward {name!r} {what} (reward_on_error: raise)", name, None, what)


def _where_raised(error: BaseException) -> str:
    """`` at FILE:LINE``: the last frame of the error's traceback (inside the reward function, or what it called)."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


@dataclass
class Scores:
    """Rewards of N completions: weighted total [N] (NaN only where no function applies), each function's raw score
    [N] (failed samples at 0, NaN where it returned None), failures, and what the functions logged."""

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    errors: list[RewardError]
    logged_columns: dict[str, list[Any]] = field(default_factory=dict)
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)

    def failure_counts(self) -> dict[str, dict[str, int]]:
        """Per function, how many samples it failed on, by kind (``raised``, ``non_finite``, ``timeout``)."""
        kinds = {"raised": 0, "non_finite": 0, "timeout": 0}
        counts = {name: dict(kinds) for name in self.per_function}
        for error in self.errors:
            counts.setdefault(error.function, dict(kinds))[error.kind] += 1
        return counts

    def failed_samples(self) -> dict[str, int]:
        """Per function, how many samples it failed on, whatever the kind."""
        return {name: sum(kinds.values()) for name, kinds in self.failure_counts().items()}

    def first_failures(self) -> dict[str, str]:
        """Per function that failed on a sample, its first failure's text."""
        first: dict[str, str] = {}
        for error in self.errors:
            first.setdefault(error.function, error.error)
        return first


_STEP: contextvars.ContextVar[str] = contextvars.ContextVar("reward_step", default="")  # "step N: ", for warnings


class RewardScorer:
    """Calls every reward function on a batch and sums the weighted scores.

    A function that raises on the batch is retried a prompt's completions at a time, and where that fails too,
    sample by sample, so that only the failing samples score 0; an infinite score is a failure of that sample (a NaN
    is a sample the function does not apply to, as None is). A `UserError` it raises is the recipe's mistake, not a
    sample's: it stops the run, without a retry. With `on_error="raise"` the
    first failure propagates instead; with `all_failed="stop"` (default) a function that failed on every
    sample of a step, on every rank, raises `RewardFailedError` naming it, the step and its first error
    (`stop_if_failed_on_all`, called by the trainer once the step's batches are scored). A call that runs past
    `timeout_s` (None: no limit) fails every sample it was given, without a retry sample by sample.
    """

    def __init__(
        self, specs: Sequence[RewardSpec], on_error: Literal["zero", "raise"] = "zero",
        all_failed: Literal["stop", "zero"] = "stop", timeout_s: float | None = 600.0,
    ) -> None:
        if not specs:
            raise RecipeError("at least one reward function is needed", "rewards")
        if on_error not in ("zero", "raise"):
            raise ValueError(f"reward_on_error must be 'zero' or 'raise', got {on_error!r}")
        if all_failed not in ("stop", "zero"):
            raise ValueError(f"reward_all_failed must be 'stop' or 'zero', got {all_failed!r}")
        rewards = [_Reward(spec) for spec in specs]
        names = [reward.name for reward in rewards]
        if again := next((i for i, name in enumerate(names) if name in names[:i]), None):
            raise RecipeError(f"reward function names must be unique: {names[again]!r} names rewards[{names.index(names[again])}] "
                              f"too (set `name:` on one), got {names}", f"rewards[{again}].name")
        self.rewards = {reward.name: reward for reward in rewards}
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"reward_timeout_s must be a finite number > 0 or null, got {timeout_s}")
        self.on_error = on_error
        self.all_failed = all_failed
        self.timeout_s = timeout_s
        self.stopped_by: dict[str, Any] | None = None  # the failure that raised RewardFailedError, as plain data

    def to(self, device: torch.device | str) -> RewardScorer:
        """Moves the rewards that hold a model (``RewardModel``) to ``device``."""
        for reward in self.rewards.values():
            if callable(getattr(reward.function, "to", None)):
                reward.function.to(device)
        return self

    @property
    def weights(self) -> dict[str, float]:
        return {name: reward.weight for name, reward in self.rewards.items()}

    def check_arguments(self, columns: Iterable[str], given: Iterable[str] = ()) -> None:
        """A ValueError naming the first reward that needs an argument neither the data's `columns` (any record's: a
        record without one gives None, as a dataset's missing value), the batch (`prompts`, `completions`) nor the
        caller's `given` arguments provide, or whose fixed kwarg shadows one; or naming a data column that has the name
        of an argument the functions are given (it would replace that)."""
        columns = list(columns)
        clash = sorted(set(columns) & {*BATCH_ARGUMENTS, *given})
        if clash:
            raise ValueError(f"the data has a column named {clash[0]!r}, the name of an argument every reward function is "
                             f"given (the {'run' if clash[0] in given else 'batch'}'s): rename the column")
        columns += list(given)
        for reward in self.rewards.values():
            reward.check_arguments(columns)

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence[Any]],
        step: int | None = None, *, chat_prompts: Sequence[Any] | None = None, chat_completions: Sequence[Any] | None = None,
        trainer_state: TrainerState | None = None,
    ) -> Scores:
        """Scores of a batch; `step` names it in errors. `prompts` and `completions` are text; for conversational
        prompts `chat_prompts` and `chat_completions` are TRL's message lists, which functions get instead unless
        they annotate `prompts` or `completions` as strings. `trainer_state`: the run's progress (a fresh run's step 0 when not given)."""
        batch = RewardBatch(
            list(prompts), list(completions), {key: list(column) for key, column in columns.items()},
            None if chat_prompts is None else list(chat_prompts), None if chat_completions is None else list(chat_completions),
        )
        where = f"step {step}: " if step is not None else ""
        said = _STEP.set(where)  # for the warnings of this thread's call alone (batches may be scored side by side)
        try:
            scores = asyncio.run(self._score(batch, trainer_state or TrainerState()))
        except _Abandoned as abandoned:  # out of the loop as an Exception: its tasks' ends are read, nothing is left
            raise abandoned.stop from None
        except RewardContractError as error:
            raise RewardContractError(f"{where}{error}") from None
        except RewardFailedError as error:  # reward_on_error: raise
            raise RewardFailedError(f"{where}{error}", error.reward, step, error.first_error) from error.__cause__
        finally:
            _STEP.reset(said)
        return scores

    def stop_if_failed_on_all(
        self, failures: Mapping[str, int], first_failures: Mapping[str, str], samples: int, step: int,
        reduce: Callable[..., torch.Tensor] = lambda tensor, reduce_op: tensor, device: torch.device | str = "cpu",
    ) -> None:
        """With ``all_failed="stop"``, a `RewardFailedError` when a function failed on every sample of step `step`.

        ``failures`` (per function) and ``samples`` are this rank's counts over every sample the step scored (every
        round of dynamic sampling); ``reduce`` (the strategy's, on ``device``) sums them over the ranks in one call, in
        this scorer's function order, since a step spans every rank: one rank's samples all failing while another's
        scored is no stop, and the ranks stop together or not at all. The message names this rank's first failure
        (``first_failures``)."""
        if self.all_failed != "stop":
            return
        names = list(self.rewards)
        counts = torch.tensor([*(failures.get(name, 0) for name in names), samples], dtype=torch.float64, device=device)
        *failed, total = (int(n) for n in reduce(counts, reduce_op="sum").tolist())
        for name, n in zip(names, failed, strict=True):
            if total and n == total:
                first = first_failures.get(name, "on another rank")
                self.stopped_by = {"reward": name, "step": step, "error": first}
                stop = RewardFailedError(f"step {step}: reward {name!r} failed on all {total} samples, first: {first} "
                                         "(reward_all_failed: zero would train on with 0 instead)", name, step, first)
                stop.on_every_rank = True  # every rank raises it: the first process says it
                raise stop

    async def _score(self, batch: RewardBatch, state: TrainerState) -> Scores:
        errors: list[RewardError] = []
        logs = RewardLogs(len(batch))
        one_at_a_time = asyncio.Lock()

        async def scored(reward: _Reward) -> torch.Tensor:
            try:
                return await self._score_one(reward, batch, state, logs, errors, one_at_a_time)
            except StepAbandoned as stop:  # a SystemExit would leave the loop at once, its task's end never read
                raise _Abandoned(stop) from None

        results = await asyncio.gather(*(scored(reward) for reward in self.rewards.values()))
        per_function = dict(zip(self.rewards, results, strict=True))
        # TRL's sum: a function that does not apply to a sample (NaN) adds nothing; none applying leaves no reward.
        total = torch.zeros(len(batch), dtype=torch.float32)
        applied = torch.zeros(len(batch), dtype=torch.bool)
        for name, values in per_function.items():
            total += self.rewards[name].weight * values.nan_to_num(nan=0.0)
            applied |= ~values.isnan()
        for i in torch.nonzero(~torch.isfinite(total)).flatten().tolist():  # finite terms whose weighted sum overflowed
            self._failed(errors, "weighted sum", i, batch, f"overflowed to {float(total[i])}", "non_finite")
            total[i] = 0.0
        unscored = torch.nonzero(~applied).flatten().tolist()
        if unscored:
            log.warning("every reward function returned None for %d of %d samples (first: %r): they get no reward and no "
                        "advantage", len(unscored), len(batch), batch.completions[unscored[0]][:200])  # fmt: skip
            total[~applied] = math.nan
        return Scores(total, per_function, errors, logs.columns, logs.metrics)

    async def _score_one(
        self, reward: _Reward, batch: RewardBatch, state: TrainerState, logs: RewardLogs, errors: list[RewardError],
        one_at_a_time: asyncio.Lock,
    ) -> torch.Tensor:
        def shared(samples: list[int]) -> dict[str, Any]:
            log_extra, log_metric = logs.for_samples(samples)
            return {"trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}

        n = len(batch)
        try:
            values, applies = await reward(batch, shared(list(range(n))), self.timeout_s, one_at_a_time)
        except (StepAbandoned, UserError):
            raise
        except RewardTimeout as error:
            if self.on_error == "raise":
                raise _raised(reward.name, f"{error}") from None
            values, applies = torch.zeros(n, dtype=torch.float32), torch.ones(n, dtype=torch.bool)
            self._timed_out(errors, reward.name, list(range(n)), batch, str(error))  # a retry per sample could cost the limit once per sample
        except (Exception, SystemExit) as error:
            if self.on_error == "raise":
                raise _raised(reward.name, f"raised {type(error).__name__}: {error}{_where_raised(error)}") from error
            values, applies = torch.zeros(n, dtype=torch.float32), torch.ones(n, dtype=torch.bool)
            groups = batch.groups()
            # Called again a prompt's completions at a time (a reward may compare them with each other: alone, each
            # would score otherwise), then, in a group that fails again, each completion alone.
            alone = groups if len(groups) == 1 and n > 1 else []  # one completion: that call was it alone
            if n == 1:
                self._failed(errors, reward.name, 0, batch, f"{type(error).__name__}: {error}", "raised")
            for group in groups if len(groups) > 1 else []:
                try:
                    values[group], applies[group] = await reward(batch.part(group), shared(group), self.timeout_s, one_at_a_time)
                except (StepAbandoned, UserError):
                    raise
                except RewardTimeout as error:  # a retry per sample could cost the limit once per sample
                    self._timed_out(errors, reward.name, group, batch, str(error))
                except (Exception, SystemExit) as error:
                    if len(group) > 1:
                        alone.append(group)
                    else:  # that was it alone
                        self._failed(errors, reward.name, group[0], batch, f"{type(error).__name__}: {error}", "raised")
            for group in alone:
                if len(group) > 1:
                    log.warning("reward %r failed on the completions of prompt %r together: each is scored alone, which "
                                "changes the scores of a reward that compares them with each other", reward.name, batch.prompts[group[0]][:200])
                for i in group:
                    try:
                        one, one_applies = await reward(batch.part([i]), shared([i]), self.timeout_s, one_at_a_time)
                        values[i], applies[i] = one[0], one_applies[0]
                    except (StepAbandoned, UserError):
                        raise
                    except RewardTimeout as error:
                        self._failed(errors, reward.name, i, batch, str(error), "timeout")
                    except (Exception, SystemExit) as error:  # a broken reward must not end the run: the sample scores 0
                        self._failed(errors, reward.name, i, batch, f"{type(error).__name__}: {error}", "raised")
        for i in torch.nonzero(~torch.isfinite(values) & applies).flatten().tolist():  # never into the advantages
            message = f"returned {float(values[i])}"
            if self.on_error == "raise":
                raise _raised(reward.name, f"{message} for sample {i}")
            self._failed(errors, reward.name, i, batch, message, "non_finite")
            values[i] = 0.0
        return values

    def _timed_out(self, errors: list[RewardError], name: str, samples: list[int], batch: RewardBatch, message: str) -> None:
        """A call that timed out fails every sample it was given: one line for them all."""
        if len(samples) == 1:
            return self._failed(errors, name, samples[0], batch, message, "timeout")
        log.warning("%sreward %r failed on the %d samples of one call (%d to %d of %d): %s", _STEP.get(), name, len(samples),
                    samples[0], samples[-1], len(batch), message)
        errors.extend(RewardError(name, i, batch.prompts[i], batch.completions[i], message, "timeout") for i in samples)

    def _failed(
        self, errors: list[RewardError], name: str, i: int, batch: RewardBatch, message: str,
        kind: Literal["raised", "non_finite", "timeout"],
    ) -> None:
        log.warning("%sreward %r failed on sample %d of %d (prompt %r, completion %r): %s", _STEP.get(), name, i, len(batch),
                    batch.prompts[i][-200:], batch.completions[i][:200], message)
        errors.append(RewardError(name, i, batch.prompts[i], batch.completions[i], message, kind))
