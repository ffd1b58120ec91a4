"""Worker processes that run Math-Verify (`math_grade.grade`) for the `math` reward.

Owned here: `GradePool`. Math-Verify bounds its parsing and comparisons with `signal.alarm`,
which works only on a process's main thread; the reward stage runs on a scheduler thread, so
`grade` runs in a `processes.worker_pool.WorkerPool` (spawned workers), where those bounds hold
and several answers are graded at once. The pool starts at the first answer our fast match
leaves undecided (a run whose answers all match quickly never starts it). An answer a worker
still has not graded within `call_timeout_s` (a pathological input Math-Verify's bounds miss)
comes back as a timeout (`reward/timeouts`), and the pool is replaced (its workers killed), so
one answer cannot stall the reward stage.
"""

from __future__ import annotations

from megatron_async_rl.processes.worker_pool import WorkerPool


def _init_worker() -> None:
    import math_verify  # noqa: F401 - imported once per worker, not per answer


def _grade(response: str, answer: str) -> bool:
    from megatron_async_rl.rewards.math_grade import grade

    return grade(response, answer)


class GradePool:
    """`grade_many(pairs)` -> one bool (or exception) per (response, answer)."""

    def __init__(self, workers: int = 2, call_timeout_s: float = 30.0):
        self.pool = WorkerPool(workers, call_timeout_s, "math reward: Math-Verify",
                               initializer=_init_worker)  # fmt: skip

    @property
    def call_timeout_s(self) -> float:
        return self.pool.call_timeout_s

    @call_timeout_s.setter
    def call_timeout_s(self, value: float) -> None:
        self.pool.call_timeout_s = value

    def grade_many(self, pairs: list[tuple[str, str]]) -> list[bool | Exception]:
        return self.pool.run_many(_grade, pairs)

    def close(self) -> None:
        self.pool.close()
