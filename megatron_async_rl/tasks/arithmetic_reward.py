"""Reward of the synthetic arithmetic task (`arithmetic`), the quick start's verifiable task.

Called by the reward stage through `registry.get_reward("arithmetic")`; the task's rows come
from `tasks/arithmetic.py` (`{"prompt": "3+5=", "answer": "8"}`). The response must start
with the answer: its text up to the first `<eos>` (when the decoder kept special tokens) and the
first whitespace is read as an integer (`08` reads as 8) and compared exactly. Anything else,
such as `8+0` or `eight`, scores 0.0: the quick start measures whether RL teaches arithmetic in
the format the warm start taught, so the reward is strict about both.
"""

from __future__ import annotations

import re

from megatron_async_rl.rewards.registry import register

EOS_TEXT = "<eos>"
_INTEGER = re.compile(r"[-+]?\d+")


def parse_response(response_text: str) -> int | None:
    """The integer a response answers with, or None when it does not start with one."""
    head = response_text.split(EOS_TEXT, 1)[0].strip()
    first = head.split(maxsplit=1)[0] if head else ""
    return int(first) if _INTEGER.fullmatch(first) else None


@register("arithmetic")
def arithmetic_reward(response_text: str, answer: str, metadata: dict) -> float:
    """1.0 when the response's leading integer equals the integer answer, else 0.0."""
    value = parse_response(response_text)
    return 1.0 if value is not None and value == int(str(answer).strip()) else 0.0
