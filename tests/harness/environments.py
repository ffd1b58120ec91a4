"""Scripted multi-turn environments for rollout tests: on `FakeEngine`
(`tests/unit/test_multiturn.py`) and on the real SGLang engine
(`tests/distributed/test_sglang_engine.py`)."""

from __future__ import annotations

from megatron_async_rl.rollout.environment import StepResult


class ToolTurns:
    """Answers two tool messages, then says done with reward 1; `fail_on` raises instead."""

    def __init__(self, fail_on: str | None = None):
        self.turn, self.fail_on = 0, fail_on

    def reset(self, sample):
        if sample.prompt == self.fail_on:
            raise RuntimeError("broken environment")
        return None

    def step(self, action):
        self.turn += 1
        if self.turn == 3:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "tool", "content": f"result {self.turn}"}], 0.0, False)
