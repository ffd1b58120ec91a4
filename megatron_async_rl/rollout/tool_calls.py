"""Tool calls in a model's output, in the format of its family: parsing, pure.

Owned here: `parse_tool_calls(text, fmt, tools)` -> `ParsedTurn` (the text outside the calls,
the calls, and one error message per malformed call), and `FORMATS`. Formats:
- `hermes` (Qwen2.5/Qwen3, Hermes, and most chat templates with tools), this project's parser:
  each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `arguments` may also
  be a JSON string holding the object (some models write it so); a turn that ends after a
  whole call without its closing tag (the model stopped there) keeps it, as vLLM's and SGLang's
  Hermes parsers do.
- every other format SGLang's `FunctionCallParser` knows, by SGLang's names (`SGLANG_FORMATS`:
  `deepseekv3`, `deepseekv31`, `llama3`, `qwen3_coder`, `gpt-oss`, `kimi_k2`, `glm45`,
  `mistral`, `pythonic`, ...): SGLang's detector of that family parses the finished turn
  (one-shot), with the tools declared to it. Their markers are often special tokens: the
  turn is then decoded with them (`decodes_special_tokens`).
A malformed call (bad JSON, no name, arguments not an object, an unclosed tag around a cut
call) is not executed:
its error goes back to the model as the tool's answer, and the environment counts it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megatron_async_rl.rollout.config import SGLANG_TOOL_FORMATS as SGLANG_FORMATS  # noqa: F401
from megatron_async_rl.rollout.config import TOOL_FORMATS as FORMATS

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


def decodes_special_tokens(fmt: str) -> bool:
    """Whether turns in `fmt` are decoded with their special tokens (SGLang's detectors look
    for markers that many families make special tokens; the Hermes tags are plain text)."""
    return fmt != "hermes"


def parse_tool_calls(text: str, fmt: str = "hermes", tools: list[dict] | None = None) -> ParsedTurn:
    """The calls in a finished turn. `tools`: the tools' schemas (`{"type": "function",
    "function": {...}}`), which SGLang's detectors are given."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r}: known formats are {', '.join(FORMATS)}")
    if fmt != "hermes":
        return _parse_with_sglang(text, fmt, tools or [])
    turn = ParsedTurn(text=_HERMES.sub("", text).strip())
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            if not match.group(0).endswith("</tool_call>"):  # cut short: the length limit
                turn.errors.append(f"unclosed <tool_call>: {body[:80]!r}")
            else:
                turn.errors.append(f"tool call is not JSON ({err.msg} at {err.pos}): "
                                   f"{body[:80]!r}")  # fmt: skip
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


def _parse_with_sglang(text: str, fmt: str, tools: list[dict]) -> ParsedTurn:
    """SGLang's detector for `fmt` on the whole turn; calls whose arguments are not a JSON
    object, and a turn the detector cannot parse, are errors for the model."""
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    declared = [Tool(type="function", function=Function(**t["function"])) for t in tools]
    parser = FunctionCallParser(declared, fmt)
    if fmt == "gpt-oss" and text.startswith("<|channel|>"):
        # harmony: the prompt ends with `<|start|>assistant`, so a turn begins at its channel;
        # SGLang's detector looks for the whole header
        text = "<|start|>assistant" + text
    if not parser.has_tool_call(text):
        return ParsedTurn(text=text.strip())
    try:
        normal, items = parser.parse_non_stream(text)
    except Exception as err:  # noqa: BLE001 - the detector's own reasons, for the model
        return ParsedTurn(text=text.strip(), errors=[f"tool calls do not parse ({fmt}): {err}"])
    turn = ParsedTurn(text=(normal or "").strip())
    if not items:  # the markers of a call, but nothing the detector could read in them
        turn.errors.append(f"a tool call that does not parse ({fmt}): {text.strip()[:80]!r}")
    for item in items:
        try:
            arguments = json.loads(item.parameters) if item.parameters else {}
        except json.JSONDecodeError as err:
            turn.errors.append(f"tool call {item.name!r}: arguments are not JSON ({err.msg})")
            continue
        if not isinstance(item.name, str) or not isinstance(arguments, dict):
            turn.errors.append(f"tool call {item.name!r}: 'arguments' must be an object")
            continue
        turn.calls.append(ToolCall(item.name, arguments))
    return turn
