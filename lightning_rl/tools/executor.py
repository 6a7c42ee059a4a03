"""Running tool calls. Whatever goes wrong becomes an error message for the model, never a crash.

A call is checked here (it parsed, names a known tool, its arguments pass the schema and bind to the
function's signature), then runs in a worker process (`worker.py`): a tool that calls `sys.exit`, raises
any `BaseException`, prints megabytes or crashes its interpreter is answered with an error message, and
one that overruns `timeout_s` is killed and its worker replaced, so it can neither hang the run nor use
up the executor. Every answer the model sees is cut to `max_output_chars`. A stop signal does not wait for a call
(`stopping.StepAbandoned`).

Failures are told apart by who caused them: a call the model wrote badly or whose tool raised (the tool's own error,
``sys.exit`` included) or overran its time is the rollout's doing and stays in training; a worker process that died
under the call (killed, crashed, out of memory) or could not start is ``worker_lost``, an infrastructure failure whose
rollout is left out of the advantages (`Rollout.infra_failure`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

from lightning_rl.stopping import StepAbandoned, wait_unless_stopping
from lightning_rl.tools.arguments import validated_arguments
from lightning_rl.tools.calls import ToolCall
from lightning_rl.tools.schema import Tool, check_sendable
from lightning_rl.tools.worker import truncate

log = logging.getLogger(__name__)

FailureKind = Literal["malformed", "unknown_tool", "invalid_arguments", "raised", "timeout", "worker_lost"]

WORKER_START_TIMEOUT_S = 120.0  # a fresh interpreter importing the tool's module; not counted in a call's timeout


@dataclass
class ToolOutcome:
    """What a call produced: `content` goes back to the model as the tool's output."""

    call: ToolCall
    content: str
    failure: FailureKind | None = None
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failure is None


class _Timeout(Exception):
    pass


class _WorkerLost(Exception):
    """The worker process died (or never started): the message says how."""


class _Worker:
    """One worker process, in a session of its own, and our end of its socket pair."""

    def __init__(self, max_output_chars: int) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from lightning_rl.tools.worker import main; main()",
                 str(theirs.fileno()), str(os.getpid()), str(max_output_chars)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},  # the tool's module imports there too
            )  # fmt: skip
        self.connection = Connection(ours.detach())
        self.ready = False

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, payload: bytes, timeout_s: float) -> tuple[str, str]:
        """The worker's answer to one pickled (function, arguments)."""
        try:
            if not self.ready:
                if not wait_unless_stopping(self.connection.poll, WORKER_START_TIMEOUT_S, "a tool's worker process"):
                    raise _WorkerLost(f"its worker process did not start within {WORKER_START_TIMEOUT_S:g} s")
                self.connection.recv()
                self.ready = True
            self.connection.send_bytes(payload)
            if not wait_unless_stopping(self.connection.poll, timeout_s, "a tool call"):
                raise _Timeout
            return self.connection.recv()
        except (EOFError, OSError):  # the other end is gone
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1.0)
            code = self.process.returncode
            how = "ended" if code is None else f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise _WorkerLost(f"its worker process {how}") from None

    def kill(self) -> None:
        """SIGKILL to the worker's process group (the tool's own children too); never waits."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def discard(self) -> None:
        self.kill()
        self.connection.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=1.0)  # reap it; one stuck in the kernel is left to the OS


class ToolExecutor:
    """Validates and runs calls against a fixed set of tools, counting failures by kind.

    Up to `max_workers` calls run at once (`run_all`), each in a worker process that is reused until a call
    overruns `timeout_s` or kills it. Tool functions must therefore be importable by module path (not lambdas
    or nested functions); what they print is discarded, what they return is what the model reads.
    """

    def __init__(
        self, tools: Sequence[Tool], timeout_s: float = 10.0, max_workers: int = 4, max_output_chars: int = 4000
    ) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if not timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_output_chars < 1:
            raise ValueError(f"tool_output_max_chars must be >= 1, got {max_output_chars}")
        for tool in tools:
            check_sendable(tool)
        self.tools = {tool.name: tool for tool in tools}
        self._signatures = {tool.name: _signature(tool.function) for tool in tools}
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.max_output_chars = max_output_chars
        self.failures: Counter[str] = Counter()
        self.calls = 0
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def run(self, call: ToolCall) -> ToolOutcome:
        try:
            outcome = self._run(call)
        except Exception as error:  # no worker could be started (out of processes or memory): the call fails, not the run
            log.warning("tool call %r could not run: %s: %s", call.name, type(error).__name__, error)
            outcome = ToolOutcome(call, f"Error: {call.name} could not run: {type(error).__name__}: {error}", "worker_lost")
        outcome.content = truncate(outcome.content, self.max_output_chars)
        with self._lock:
            self.calls += 1
            if outcome.failure is not None:
                self.failures[outcome.failure] += 1
        return outcome

    def run_all(self, calls: Sequence[ToolCall]) -> list[ToolOutcome]:
        """The outcomes of `calls`, in order, up to `max_workers` running at once."""
        if len(calls) <= 1 or self.max_workers == 1:
            return [self.run(call) for call in calls]
        outcomes: list[ToolOutcome | None] = [None] * len(calls)
        jobs: queue.SimpleQueue[tuple[int, ToolCall]] = queue.SimpleQueue()
        for job in enumerate(calls):
            jobs.put(job)

        def drain() -> None:
            while True:
                try:
                    i, call = jobs.get_nowait()
                except queue.Empty:
                    return
                outcomes[i] = self.run(call)

        # Daemon threads: each waits at most one call's timeout, and an exiting interpreter never joins them.
        threads = [threading.Thread(target=drain, name="tool-call", daemon=True) for _ in range(min(self.max_workers, len(calls)))]
        for thread in threads:
            thread.start()
        for thread in threads:  # on the trainer's thread a stop signal does not wait for them (`close` ends their calls)
            wait_unless_stopping(lambda seconds: thread.join(seconds) or not thread.is_alive(), None, "tool calls")
        assert all(outcome is not None for outcome in outcomes)
        return outcomes  # type: ignore[return-value]

    def _run(self, call: ToolCall) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(call, f"Error: {call.error}", "malformed")
        tool = self.tools.get(call.name or "")
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolOutcome(call, f"Error: unknown tool {call.name!r} (available: {known})", "unknown_tool")
        try:
            arguments = validated_arguments(call.arguments, tool.parameters)
            signature = self._signatures[tool.name]
            if signature is not None:
                try:
                    signature.bind(**arguments)  # what the schema allows but the function does not take
                except TypeError as error:
                    raise ValueError(error) from None
        except ValueError as error:
            return ToolOutcome(call, f"Error: invalid arguments for {tool.name}: {error}", "invalid_arguments")
        payload = pickle.dumps((tool.function, arguments))
        worker = self._take_worker()
        if worker is None:
            return ToolOutcome(call, f"Error: {tool.name} was not run: the run is ending", "raised", arguments)
        try:
            status, text = worker.call(payload, self.timeout_s)
        except StepAbandoned:  # the run is stopping: the call's worker goes with it
            self._drop_worker(worker)
            raise
        except _Timeout:
            self._drop_worker(worker)
            return ToolOutcome(call, f"Error: {tool.name} did not finish within {self.timeout_s:g} s", "timeout", arguments)
        except _WorkerLost as error:
            self._drop_worker(worker)
            return ToolOutcome(call, f"Error: {tool.name} failed: {error}", "worker_lost", arguments)
        self._return_worker(worker)
        if status == "raised":  # the tool's own failure is reported to the model
            return ToolOutcome(call, f"Error: {tool.name} raised {text}", "raised", arguments)
        return ToolOutcome(call, text, None, arguments)

    def _take_worker(self) -> _Worker | None:
        with self._lock:
            if self._closed:
                return None
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    break
                worker.discard()
            else:
                worker = _Worker(self.max_output_chars)  # a replacement for one that was killed, or the first
            self._busy.add(worker)
            return worker

    def _return_worker(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed and len(self._idle) < self.max_workers:
                self._idle.append(worker)
                return
        worker.discard()

    def _drop_worker(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.discard()

    def close(self) -> None:
        """Kill every worker, a busy one included (its caller gets an error outcome at once); never waits."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for worker in busy:
            worker.kill()  # its caller sees the socket close, and discards it
        for worker in idle:
            worker.kill()
            worker.connection.close()


def _signature(function: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None
