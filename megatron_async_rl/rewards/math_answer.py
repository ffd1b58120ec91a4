"""Verifiable math reward (`math`): our fast answer match, and Math-Verify for the rest.

Called by the reward stage through `registry.get_reward("math")` (`MathReward`; the verdict's
rules: `rewards/math_grade.py`; the fast match: `rewards/math_match.py`).
"""

from __future__ import annotations

from megatron_async_rl.rewards.registry import register


class MathReward:
    """The `math` reward: 1.0 when the response's answer is right, else 0.0 (the verdict:
    `rewards/math_grade.py`). Our fast match decides in this process; what it leaves undecided
    goes to Math-Verify: on a process's main thread here (its timeouts work there), elsewhere
    and for batches (`score_batch`, which `SafeReward.score` uses) to a pool of `workers`
    processes (`rewards/math_pool.py`), each answer bounded by `call_timeout_s`."""

    def __init__(self, workers: int = 2, call_timeout_s: float = 30.0):
        self.workers, self.call_timeout_s = workers, call_timeout_s
        self._pool = None

    def with_config(self, config) -> MathReward:
        """The reward for a recipe's `reward:` section (`reward.workers`)."""
        return MathReward(config.workers, config.call_timeout_s or self.call_timeout_s)

    def __call__(self, response_text: str, answer: str, metadata: dict) -> float:
        (value,) = self.score_batch([(response_text, answer, metadata)])
        if isinstance(value, Exception):
            raise value
        return value

    def score_batch(self, items: list[tuple[str, str, dict]]) -> list[float | Exception]:
        """One value per (response_text, answer, metadata), or the exception that sample
        raised (a Math-Verify timeout: `RewardTimeoutError`)."""
        import threading

        from megatron_async_rl.rewards.math_grade import grade, quick_grade

        out: list[float | Exception | None] = []
        undecided: list[int] = []
        for index, (response, answer, _) in enumerate(items):
            quick = quick_grade(response, str(answer))
            out.append(None if quick is None else float(quick))
            if quick is None:
                undecided.append(index)
        if len(undecided) == 1 and threading.current_thread() is threading.main_thread():
            index = undecided[0]
            out[index] = float(grade(items[index][0], str(items[index][1])))
        elif undecided:
            if self._pool is None:
                from megatron_async_rl.rewards.math_pool import GradePool

                self._pool = GradePool(self.workers, self.call_timeout_s)
            verdicts = self._pool.grade_many([(items[i][0], str(items[i][1])) for i in undecided])
            for index, verdict in zip(undecided, verdicts, strict=True):
                out[index] = verdict if isinstance(verdict, Exception) else float(verdict)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


math_reward = register("math")(MathReward())
