"""Module-level tools for `tests/unit/test_tools.py` (worker processes import them by name)."""

import time


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "slept"


def huge(n: int) -> str:
    """Answer with n characters.

    Args:
        n: how many
    """
    return "x" * n


def broken(x: int) -> int:
    """Always raise.

    Args:
        x: anything
    """
    raise ValueError(f"broken on {x}")


def undocumented(x):
    return x


class CountdownEnv:
    """A plug-in environment: `done` after `turns` steps, reward 1 per step."""

    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, sample):
        return f"start {sample.prompt}"

    async def step(self, action):
        from megatron_async_rl.rollout.environment import StepResult

        self.turns -= 1
        return StepResult(f"left {self.turns}", 1.0, self.turns == 0)


class NotAnEnv:
    def reset(self, sample):
        return None


def stamped(seconds: float) -> list:
    """Sleep, and say when (wall clock) the call started and ended.

    Args:
        seconds: how long to sleep
    """
    start = time.time()
    time.sleep(seconds)
    return [start, time.time()]
