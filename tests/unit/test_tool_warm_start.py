"""The tool-use warm start's examples (`tasks/tool_warm_start.py`) are the rollout's tokens.

Contracts: a conversation's ids are the prompt, each call then `<eos>`, the tool's answer as
`turns.observation_ids` renders it, the final answer then `<eos>` (what the multi-turn rollout
builds); labels are the ids on the model's tokens and -100 on the prompt and tool tokens; the
plan of each task is right without noise, and the noise changes arguments and answers at the
rates asked for. The code task's tool answer, computed for the warm start, is the sandbox's
answer to the same program (its real twin, where bubblewrap is installed). The training run
itself is measured in the note (`benchmarks/multiturn_tools.py`).
"""

from __future__ import annotations

import random

import pytest

from megatron_async_rl.models.tiny import build_tokenizer
from megatron_async_rl.rollout.turns import observation_ids
from megatron_async_rl.sandbox.command import find_bwrap
from megatron_async_rl.tasks.calculator import PRICES
from megatron_async_rl.tasks.code_task import product_rows, tool_answer
from megatron_async_rl.tasks.tool_warm_start import call_text, conversation, plan


def test_plans_are_right_without_noise():
    assert plan("348+576=", "sum") == ([("add", {"a": 348, "b": 576})], "924")
    calls, final = plan("pear+348=", "price")
    assert calls == [("price", {"item": "pear"}), ("add", {"a": PRICES["pear"], "b": 348})]
    assert final == str(PRICES["pear"] + 348)
    rng = random.Random(0)
    plans = [plan("348+576=", "sum", rng, 0.25, 0.5) for _ in range(2000)]
    right_args = sum(calls == [("add", {"a": 348, "b": 576})] for calls, _ in plans) / 2000
    copied = sum(final == str(sum(calls[0][1].values())) for calls, final in plans) / 2000
    assert abs(right_args - 0.25) < 0.04 and abs(copied - 0.5) < 0.04


def test_the_code_task_plans_a_program_for_the_python_tool():
    assert plan("348*576=", "code") == ([("python", {"code": "print(348*576)"})], "200448")
    rows = product_rows(50, seed=3)
    assert all(int(r["answer"]) == eval(r["prompt"].rstrip("=")) for r in rows)  # noqa: S307
    rng = random.Random(0)
    plans = [plan("348*576=", "code", rng, 0.75, 0.75) for _ in range(2000)]
    right = sum(calls[0][1]["code"] == "print(348*576)" for calls, _ in plans) / 2000
    assert abs(right - 0.75) < 0.04
    tok = build_tokenizer()
    ids, _ = conversation([], *plans[0], tok)
    assert tok.unk_token_id not in ids


@pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap is not installed")
def test_the_code_tasks_answers_are_the_sandboxs():
    from megatron_async_rl.sandbox.tools import python

    for code in ("print(348*576)", "print(100*999)"):
        assert tool_answer(code) == python(code) == f"exit status 0\nstdout:\n{eval(code[6:-1])}"
    # another program is run in the sandbox: its error is the tool's answer
    other = tool_answer("print(348*)")
    assert other.startswith("exit status 1") and "SyntaxError" in other


def test_labels_cover_exactly_the_model_tokens():
    tok = build_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "pear+348="}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)  # fmt: skip
    calls, final = plan("pear+348=", "price")
    ids, labels = conversation(prompt, calls, final, tok)
    eos = tok.eos_token_id
    model = [tok.encode(call_text(n, a), add_special_tokens=False) + [eos] for n, a in calls]
    tools = [observation_ids(tok, [{"role": "tool", "content": text}])
             for text in (str(PRICES["pear"]), str(PRICES["pear"] + 348))]  # fmt: skip
    answer = tok.encode(final, add_special_tokens=False) + [eos]
    assert ids == prompt + model[0] + tools[0] + model[1] + tools[1] + answer
    expected = ([-100] * len(prompt) + model[0] + [-100] * len(tools[0]) + model[1]
                + [-100] * len(tools[1]) + answer)  # fmt: skip
    assert labels == expected
    assert tok.unk_token_id not in ids  # the JSON of a call is all known characters
