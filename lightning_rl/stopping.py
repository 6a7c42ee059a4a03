"""The run's stop request, which the waits that could outlast a stop signal watch (a reward or a tool that does not
return); a leaf.

``RequeueOnSignal`` requests the stop when a stop signal comes inside a training step it may abandon (one process;
between two optimizer steps). A wait on the trainer's thread (the main one, where signal handlers run) that sees it
gives up at once with ``StepAbandoned``; the callback then saves the last complete step, whose weights the abandoned
one had not yet changed, and the process exits 143. A wait on another thread (async GRPO's rollout producer) runs
to its own end or timeout: its failure would reach the trainer's thread wrapped as a producer failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

EXIT_CODE = 128 + 15  # the shell's code for a process ended by SIGTERM
POLL_S = 0.05  # how often a wait looks at the request: a signal is honoured within this

# A plain flag, not a threading.Event: a signal handler sets it, and an Event's lock, taken by the handler while the
# interrupted main thread holds it, would never be released.
_requested = False


class StepAbandoned(SystemExit):
    """A training step given up because the run is stopping; ``what`` it was waiting for.

    A ``SystemExit`` with code 143: the handlers of a reward's or a tool's own failures (``except Exception``) let it
    through, and nothing that does not handle it prints a traceback; the process ends as the signal asked."""

    def __init__(self, what: str) -> None:
        super().__init__(EXIT_CODE)
        self.what = what


def request_stop() -> None:
    global _requested
    _requested = True


def withdraw_stop() -> None:
    global _requested
    _requested = False


def abandon_if_stopping(what: str) -> None:
    """Raise ``StepAbandoned`` if the stop is requested and this is the trainer's thread."""
    if _requested and threading.current_thread() is threading.main_thread():
        raise StepAbandoned(what)


def wait_unless_stopping(done: Callable[[float], bool], timeout_s: float | None, what: str) -> bool:
    """Calls ``done(seconds)`` (it waits up to ``seconds`` and says whether the awaited thing is done) until it is,
    ``timeout_s`` has passed (False) or the stop is requested (``StepAbandoned``, see ``abandon_if_stopping``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        abandon_if_stopping(what)
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if done(max(left, 0.0)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
