"""Faulty tools and environments for `scripts/multiturn_faults.sh` (worker processes import them).

`add` fails by its arguments, so every fault recurs at a steady rate: (a + b) % 8 == 0 hangs for
60 s (past any `tool_timeout_s` a recipe sets), == 1 raises, == 2 answers with 1 MB of text;
otherwise the sum. `FlakyReset` raises in `reset` for every fourth prompt (by its text), else
answers once and ends.
"""

import time
import zlib


def add(a: int, b: int) -> int:
    """Adds two integers (with faults: see the module docstring).

    Args:
        a: The first integer.
        b: The second integer.
    """
    kind = (int(a) + int(b)) % 8
    if kind == 0:
        time.sleep(60)
    if kind == 1:
        raise ArithmeticError(f"add({a}, {b}) failed on purpose")
    if kind == 2:
        return "9" * 2**20
    return int(a) + int(b)


class FlakyReset:
    """An environment whose `reset` raises for every fourth prompt."""

    def reset(self, sample):
        if zlib.crc32(str(sample.prompt).encode()) % 4 == 0:
            raise ConnectionError("the environment's backend is down")
        return None

    def step(self, action):
        from megatron_async_rl.rollout.environment import StepResult

        return StepResult(None, 0.0, True)
