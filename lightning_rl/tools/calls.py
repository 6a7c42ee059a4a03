"""Finding tool calls in a model's output.

Chat templates of the Qwen/Hermes family (our tiny model's included) render a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the tags are parameters for templates
that use others.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    """One call as the model wrote it. `error` is set when it could not even be read."""

    raw: str
    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str, start: str = TOOL_CALL_START, end: str = TOOL_CALL_END) -> list[ToolCall]:
    """Every `start ... end` block of `text`, decoded; an unterminated block is a malformed call."""
    calls = []
    pattern = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|$)", re.DOTALL)
    for match in pattern.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith(end):
            calls.append(ToolCall(raw=body, error=f"tool call is not closed with {end}"))
            continue
        calls.append(_decode(body))
    return calls


def _decode(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(raw=body, error=f"tool call is not valid JSON: {error.msg} at position {error.pos}")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(raw=body, error='tool call must be a JSON object with a string "name"')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some templates serialise arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return ToolCall(raw=body, name=payload["name"], error=f"arguments are not valid JSON: {error.msg}")
    if not isinstance(arguments, dict):
        return ToolCall(raw=body, name=payload["name"], error='"arguments" must be a JSON object')
    return ToolCall(raw=body, name=payload["name"], arguments=arguments)
