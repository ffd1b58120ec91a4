"""`environment.tool_format`: every format of SGLang's `FunctionCallParser` besides this
project's `hermes`, parsed by SGLang's own detector of that family on a finished turn.

Contracts: the formats a recipe may name are exactly SGLang's (less `hermes`, ours, and
`response_template`); one call per family parses to the exact name and arguments, the text
around it is kept, a turn without a call is the final answer, arguments that are not a JSON
object are an error for the model; a family whose markers are special tokens keeps them when
the turn is decoded (`decode_turn`), and loses its calls without that.

The turns follow the examples in each detector's docstring in SGLang 0.5.23
(`sglang/srt/function_call/<family>_detector.py`), which its tests use
(`test/srt/test_function_call_parser.py` in the SGLang repository).
"""

from __future__ import annotations

import pytest

from megatron_async_rl.rollout.multiturn import decode_turn
from megatron_async_rl.rollout.tool_calls import (
    FORMATS,
    SGLANG_FORMATS,
    ToolCall,
    decodes_special_tokens,
    parse_tool_calls,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
CALL = ToolCall("get_weather", {"city": "Paris"})
TURNS = {
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                  '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseekv31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                   '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "</function>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
               "<|tool_calls_section_end|>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "</tool_call>",
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
}  # fmt: skip
WHOLE_TURNS = {  # a call is the whole turn in these families
    "pythonic": '[get_weather(city="Paris")]',
    "gpt-oss": '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>'
               '{"city": "Paris"}<|call|>',
}  # fmt: skip


def test_the_formats_are_sglangs():
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    theirs = set(FunctionCallParser.ToolCallParserEnum) - {"hermes", "response_template"}
    assert set(SGLANG_FORMATS) == theirs
    assert FORMATS[0] == "hermes" and len(set(FORMATS)) == len(FORMATS)


@pytest.mark.parametrize("fmt", list(TURNS))
def test_a_call_in_each_family_parses_with_the_text_around_it(fmt):
    turn = parse_tool_calls("Let me check. " + TURNS[fmt], fmt, [WEATHER])
    assert turn.calls == [CALL] and not turn.errors, turn
    assert turn.text.startswith("Let me check."), turn.text


@pytest.mark.parametrize("fmt", list(WHOLE_TURNS))
def test_a_call_that_is_the_whole_turn_parses(fmt):
    turn = parse_tool_calls(WHOLE_TURNS[fmt], fmt, [WEATHER])
    assert turn.calls == [CALL] and not turn.errors, turn


@pytest.mark.parametrize("fmt", [*TURNS, *WHOLE_TURNS])
def test_a_turn_without_a_call_is_the_answer(fmt):
    turn = parse_tool_calls("The answer is 42.", fmt, [WEATHER])
    assert turn.calls == [] and not turn.errors and turn.text == "The answer is 42."


@pytest.mark.parametrize("fmt", ["deepseekv31", "kimi_k2"])
def test_arguments_that_are_not_an_object_are_an_error(fmt):
    text = TURNS[fmt].replace('{"city": "Paris"}', '["Paris"]')
    turn = parse_tool_calls(text, fmt, [WEATHER])
    assert not turn.calls and len(turn.errors) == 1, turn
    assert "get_weather" in turn.errors[0]


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="known formats are hermes, apertus2509"):
        parse_tool_calls("x", "llama9")


def test_markers_that_are_special_tokens_survive_decoding(tiny_model):
    """DeepSeek's markers are special tokens of its tokenizer: decoded without them the call
    is lost; `decode_turn` keeps them and drops only the end-of-turn token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    markers = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
               "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    ids = tokenizer.encode("Let me check. " + TURNS["deepseekv31"], add_special_tokens=False)
    ids.append(tokenizer.eos_token_id)
    assert all(tokenizer.convert_tokens_to_ids(m) in ids for m in markers)
    assert decodes_special_tokens("deepseekv31") and not decodes_special_tokens("hermes")
    kept = decode_turn(tokenizer, ids, keep_special_tokens=True)
    assert parse_tool_calls(kept, "deepseekv31", [WEATHER]).calls == [CALL]
    assert tokenizer.eos_token not in kept
    lost = decode_turn(tokenizer, ids, keep_special_tokens=False)
    assert parse_tool_calls(lost, "deepseekv31", [WEATHER]).calls == []
