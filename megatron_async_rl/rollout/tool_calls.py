"""Tool calls in a model's output, in the format of its family: parsing, pure.

Owned here: `parse_tool_calls(text, fmt)` -> `ParsedTurn` (the text outside the calls, the
calls, and one error message per malformed call), and `FORMATS`. Formats:
- `hermes` (Qwen2.5/Qwen3, Hermes, and most chat templates with tools): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `arguments` may also be a JSON
  string holding the object (some models write it so).
A malformed call (bad JSON, no name, arguments not an object, an unclosed tag) is not executed:
its error goes back to the model as the tool's answer, and the environment counts it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes",)

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    text: str
    """The output with the calls removed (what the model said around them)."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, for the model (and counted)."""


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r}: known formats are {', '.join(FORMATS)}")
    turn = ParsedTurn(text=_HERMES.sub("", text).strip())
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            turn.errors.append(f"unclosed <tool_call>: {body[:80]!r}")
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            turn.errors.append(f"tool call is not JSON ({err.msg} at {err.pos}): {body[:80]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            turn.errors.append(f"tool call needs a string 'name': {body[:80]!r}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            turn.errors.append(f"tool call {call['name']!r}: 'arguments' must be an object")
            continue
        turn.calls.append(ToolCall(call["name"], arguments))
    return turn
