"""Tool use through each family's own chat template (`tests/data/chat_templates/`, the templates
the vendors publish with their models; sources, licences and what each needs:
`SOURCES.md` there), with a tiny tokenizer that carries the family's special tokens.

Contracts, per family: the prompt rendered with `tools=` holds the tool's schema where the
template renders tools (DeepSeek-V3's and V3.1's published templates ignore `tools=`: their
users put the schemas in the system message); a model turn in the family's call format, ended
with the family's end-of-turn token, is decoded as the rollout decodes it (`decode_turn`, with
special tokens where the format needs them) and parses to the call; the tool's answer is
appended as the template renders it after the assistant's call (`observation_ids` with the
turn's calls, token-in / token-out) and holds the answer; templates that do not need the call
render the same tokens without it, the others (gpt-oss, Mistral) refuse with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_async_rl.rollout.multiturn import decode_turn
from megatron_async_rl.rollout.tool_calls import ToolCall, decodes_special_tokens, parse_tool_calls
from megatron_async_rl.rollout.turns import observation_ids, openai_calls

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
CALL = ToolCall("get_weather", {"city": "Paris"})
_DS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
       "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
       "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
       "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]  # fmt: skip
_IM = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
FAMILIES = {
    # format: (special tokens, bos, end of a turn, the model's call turn)
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>",
               '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>",
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    "qwen25": (_IM, None, "<|im_end|>",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               "</tool_call>"),
    "deepseekv3": (_DS, _DS[0], _DS[1],
                   "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseekv31": ([*_DS, "<think>", "</think>"], _DS[0], _DS[1],
                    "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "qwen3_coder": (_IM, None, "<|im_end|>",
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>"),
    "gpt-oss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                 "<|call|>", "<|return|>", "<|endoftext|>"], None, "<|return|>",
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris"}<|call|>'),
}  # fmt: skip
TOOLS_IGNORED = {"deepseekv3", "deepseekv31"}
NEEDS_THE_CALL = {"mistral", "gpt-oss"}
"""Templates that render a tool's answer from the assistant's call: gpt-oss names the function,
Mistral's matches the call's 9-character id."""


def family_tokenizer(fmt: str):
    """A character-level tokenizer with the family's special tokens and its template: one
    token per character of the template, the call and the schema, each special token one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, turn = FAMILIES[fmt]
    template = (TEMPLATES / f"{fmt}.jinja").read_text()
    text = (template + turn + json.dumps(WEATHER) + "Sunny, 18C 0123456789-: Checking."
            + "You check the weather. Weather in Paris?")  # fmt: skip
    chars = sorted(set(text) - set("".join(specials)) | set("".join(specials)))
    tokens = ["<pad>", "<unk>", *specials, *chars]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(["<pad>", "<unk>", *specials])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos,
                                   pad_token="<pad>", unk_token="<unk>",
                                   chat_template=template)  # fmt: skip


def _prompt(tokenizer, tools=None) -> str:
    messages = [{"role": "system", "content": "You check the weather."},
                {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
def test_the_prompt_renders_the_tools_schema(fmt):
    tokenizer = family_tokenizer(fmt)
    with_tools, without = _prompt(tokenizer, [WEATHER]), _prompt(tokenizer)
    assert "Weather in Paris?" in with_tools
    if fmt in TOOLS_IGNORED:
        assert with_tools == without  # the published template: schemas go in the system message
    else:
        assert "get_weather" in with_tools and "The weather in a city." in with_tools
        assert "get_weather" not in without
    assert tokenizer.unk_token_id not in tokenizer.encode(with_tools, add_special_tokens=False)


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
def test_a_call_turn_decodes_and_parses_to_the_call(fmt):
    tokenizer = family_tokenizer(fmt)
    _, _, eos, turn = FAMILIES[fmt]
    text = "Checking. " * (fmt not in {"gpt-oss", "llama3"}) + turn  # calls begin those turns
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids.append(tokenizer.convert_tokens_to_ids(eos))
    fmt_parse = "hermes" if fmt == "qwen25" else fmt  # the same markup: this project's parser
    text = decode_turn(tokenizer, ids, keep_special_tokens=decodes_special_tokens(fmt_parse))
    assert eos not in text
    parsed = parse_tool_calls(text, fmt_parse, [WEATHER])
    assert parsed.calls == [CALL] and not parsed.errors, (text, parsed)


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
def test_the_tools_answer_follows_as_the_template_renders_it(fmt):
    tokenizer = family_tokenizer(fmt)
    calls = openai_calls([CALL])
    answer = {"role": "tool", "content": "Sunny, 18C", "tool_call_id": calls[0]["id"],
              "name": "get_weather"}  # fmt: skip
    ids = observation_ids(tokenizer, [answer], calls)
    rendered = tokenizer.decode(ids, skip_special_tokens=False)
    assert "Sunny, 18C" in rendered and tokenizer.unk_token_id not in ids, rendered
    if fmt in NEEDS_THE_CALL:  # without the call, the template cannot render its answer
        with pytest.raises(ValueError, match="cannot render the environment's messages"):
            observation_ids(tokenizer, [answer])
    else:
        assert observation_ids(tokenizer, [answer]) == ids
