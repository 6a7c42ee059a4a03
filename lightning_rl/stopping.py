"""The run's stop request, which the waits that could outlast a stop signal watch (a reward or a tool that does not
return, async GRPO's wait for its rollout producer); it imports only the errors it raises.

``RequeueOnSignal`` says when a stop signal came (``signal_came``) and whether the trainer's thread is inside a step
it may give up (``may_abandon``: one that started at an optimizer-step boundary). A wait on the trainer's thread (the
main one, where signal handlers run) inside such a step gives up at once with ``StepAbandoned``; the callback then
saves the last complete step, whose weights the abandoned one had not yet changed, and the process exits 143.

Async GRPO's rollout producer works for batches a stopped run may not keep (``discard_on_stop``): once a stop signal
came, its waits give up too and it starts no batch, and the checkpoint holds the batches it finished, with the one in
the making as far as it got where the engine can cut its generation (``signalled``; `rollout/buffer.py`); else the
resumed run generates that one again.

With several ranks a step's inputs are fetched by ``fetched_on_every_rank``: the ranks agree, before the step's first
collective, whether one of them is giving the step up, so that a rank stuck in a reward never leaves the others
waiting in a collective it does not join; they give it up together, or none does.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from lightning_rl.errors import UserError

EXIT_CODE = 128 + 15  # the shell's code for a process ended by SIGTERM
POLL_S = 0.05  # how often a wait looks at the request: a signal is honoured within this

T = TypeVar("T")

# Plain flags, not threading.Events: a signal handler sets them, and an Event's lock, taken by the handler while the
# interrupted main thread holds it, would never be released.
_signalled = False  # a stop signal came
_abandonable = False  # the trainer's thread is inside a step it may give up
_discarded = threading.local()  # ``discard`` set: the thread's work is dropped when the run stops


class StepAbandoned(SystemExit):
    """A training step given up because the run is stopping; ``why``, for the closing line.

    A ``SystemExit`` with code 143: the handlers of a reward's or a tool's own failures (``except Exception``) let it
    through, and nothing that does not handle it prints a traceback; the process ends as the signal asked."""

    def __init__(self, why: str) -> None:
        super().__init__(EXIT_CODE)
        self.why = why


def signal_came(came: bool = True) -> None:
    """Record a stop signal (False: the run goes on after all, a requeue that no scheduler took)."""
    global _signalled
    _signalled = came


def signalled() -> bool:
    return _signalled


def may_abandon(allowed: bool) -> None:
    """Whether the trainer's thread is inside a step that a stop signal may give up."""
    global _abandonable
    _abandonable = allowed


def discard_on_stop() -> None:
    """The calling thread's work is dropped when the run stops: its waits give up as soon as a stop signal came."""
    _discarded.discard = True


def abandon_if_stopping(what: str, awaited: bool = True) -> None:
    """Raise ``StepAbandoned`` if a stop signal came and this thread may give ``what`` up: the trainer's thread inside
    a step it may abandon, or a thread that ``discard_on_stop``. ``awaited``: whether ``what`` has been waited on yet
    (a signal that came earlier in the step is not blamed on it)."""
    if not _signalled:
        return
    if (_abandonable and threading.current_thread() is threading.main_thread()) or getattr(_discarded, "discard", False):
        raise StepAbandoned(f"{what} had not returned" if awaited else f"the signal came before {what} was awaited")


def exit_on_stop_signals() -> None:
    """From now until a run installs its own handlers (``RequeueOnSignal``): SIGTERM or SIGUSR1 ends the process with
    `EXIT_CODE` and one line. The command installs it before its imports, which take seconds in which a scheduler's
    signal otherwise kills the process without a word (and with the signal's status, not 143); nothing has been
    trained or written yet then."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        print(f"{signal.Signals(signum).name} arrived before training started: the command stops, nothing trained", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE)

    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, stop)


def wait_unless_stopping(done: Callable[[float], bool], timeout_s: float | None, what: str) -> bool:
    """Calls ``done(seconds)`` (it waits up to ``seconds`` and says whether the awaited thing is done) until it is,
    ``timeout_s`` has passed (False) or the stop is requested (``StepAbandoned``, see ``abandon_if_stopping``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    awaited = False
    while True:
        abandon_if_stopping(what, awaited)
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if done(max(left, 0.0)):
            return True
        awaited = True
        if deadline is not None and time.monotonic() >= deadline:
            return False


class AnotherRankFailed(UserError, RuntimeError):
    """A step's inputs failed on another rank (a bad data row, a reward that failed throughout): this rank stops with
    that rank's exit code, and the failing rank's own line says why."""

    on_every_rank = True

    def __init__(self, exit_code: int) -> None:
        super().__init__("another rank stopped on an error while fetching the step's inputs (its own error line says which)")
        self.exit_code = exit_code


# What a rank adds to the agreement: a stop 1, a failed fetch _FAILED plus 1000 times its exit code.
_FAILED = 1_000_000_000.0


def fetched_on_every_rank(fetch: Callable[[], T], any_rank: Callable[[float], float], give_back: Callable[[T], None] | None = None) -> T:
    """``fetch()``'s result (a step's inputs, fetched in waits a stop signal may abandon) once every rank has its own.

    Then the ranks agree (``any_rank``: one all-reduce, the sum of every rank's value) whether one of them is giving
    the step up: its wait abandoned, or a stop signal come on it meanwhile. If one is, all raise ``StepAbandoned``
    before the step's first collective (a fetched result goes back through ``give_back``, to be taken again on resume);
    if none is, the step is no longer abandoned anywhere, since its collectives come next. A rank whose fetch raised
    says so in the same agreement and raises its error; the others raise `AnotherRankFailed` with its exit code,
    rather than wait in the step's collectives for a rank that never comes."""
    try:
        fetched = fetch()
    except StepAbandoned:
        any_rank(1.0)  # the others are waiting in the agreement, or will be once their own fetch returns
        raise
    except Exception as error:
        any_rank(_FAILED + 1000.0 * getattr(error, "exit_code", 1))
        raise
    local = _signalled and _abandonable
    agreed = any_rank(1.0 if local else 0.0)
    if agreed >= _FAILED:
        failed = agreed // _FAILED
        raise AnotherRankFailed(int(round((agreed - failed * _FAILED) / 1000.0 / failed)))
    if agreed:
        if give_back is not None:
            give_back(fetched)
        raise StepAbandoned("a stop signal came before its training" if local else "another rank was stopping")
    may_abandon(False)
    return fetched
