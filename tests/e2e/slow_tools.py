"""A tool that takes its time, so weight updates land while trajectories wait for it."""

import time


def slow_add(a: int, b: int) -> int:
    """Adds two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    time.sleep(0.3)
    return int(a) + int(b)


class SlowEcho:
    """An environment whose first step takes 0.3 s and answers with a tool message (reward
    0.1); the second step ends the trajectory (reward 0.2)."""

    def __init__(self):
        self.turn = 0

    def reset(self, sample):
        return None

    def step(self, action):
        from megatron_async_rl.rollout.environment import StepResult

        self.turn += 1
        if self.turn == 1:
            time.sleep(0.3)
            return StepResult([{"role": "tool", "content": "42"}], 0.1, False)
        return StepResult(None, 0.2, True)
