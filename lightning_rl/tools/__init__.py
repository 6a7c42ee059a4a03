"""Tools the model may call during a rollout, typed and validated by JSON schema."""

from lightning_rl.tools.calls import ToolCall, parse_tool_calls
from lightning_rl.tools.executor import ToolExecutor, ToolOutcome
from lightning_rl.tools.schema import Tool, as_tool, load_tool, tool_reference

__all__ = ["Tool", "ToolCall", "ToolExecutor", "ToolOutcome", "as_tool", "load_tool", "parse_tool_calls", "tool_reference"]
