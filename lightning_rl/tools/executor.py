"""Running tool calls. Whatever goes wrong becomes an error message for the model, never a crash."""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_rl.tools.arguments import validated_arguments
from lightning_rl.tools.calls import ToolCall
from lightning_rl.tools.schema import Tool

FailureKind = Literal["malformed", "unknown_tool", "invalid_arguments", "raised", "timeout"]


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


class ToolExecutor:
    """Validates and runs calls against a fixed set of tools, counting failures by kind.

    A tool that overruns `timeout_s` is reported as timed out; Python cannot stop its thread,
    which finishes in the background, so tools should not hold resources unboundedly.
    """

    def __init__(self, tools: Sequence[Tool], timeout_s: float = 10.0, max_workers: int = 4) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_s = timeout_s
        self.failures: Counter[str] = Counter()
        self.calls = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool")

    def run(self, call: ToolCall) -> ToolOutcome:
        outcome = self._run(call)
        self.calls += 1
        if outcome.failure is not None:
            self.failures[outcome.failure] += 1
        return outcome

    def _run(self, call: ToolCall) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(call, f"Error: {call.error}", "malformed")
        tool = self.tools.get(call.name or "")
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolOutcome(call, f"Error: unknown tool {call.name!r} (available: {known})", "unknown_tool")
        try:
            arguments = validated_arguments(call.arguments, tool.parameters)
        except ValueError as error:
            return ToolOutcome(call, f"Error: invalid arguments for {tool.name}: {error}", "invalid_arguments")
        future = self._pool.submit(tool.function, **arguments)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            return ToolOutcome(
                call, f"Error: {tool.name} did not finish within {self.timeout_s:g} s", "timeout", arguments
            )
        except Exception as error:  # the tool's own failure is reported to the model
            return ToolOutcome(call, f"Error: {tool.name} raised {type(error).__name__}: {error}", "raised", arguments)
        return ToolOutcome(call, str(result), None, arguments)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
