"""Worker processes that run Math-Verify (`math_grade.grade`) for the `math` reward.

Owned here: `GradePool`. Math-Verify bounds its parsing and comparisons with `signal.alarm`,
which works only on a process's main thread; the reward stage runs on a scheduler thread, so
`grade` runs in a `concurrent.futures.ProcessPoolExecutor` (spawned workers, SIGINT ignored:
the rank handles Ctrl-C), where those bounds hold and several answers are graded at once. The
pool starts at the first answer our fast match leaves undecided (a run whose answers all match
quickly never starts it). A worker that still does not answer within `call_timeout_s` (a
pathological input Math-Verify's bounds miss) gets its answers counted as timeouts; the pool
is then replaced (its processes killed), so one answer cannot stall the reward stage.
"""

from __future__ import annotations

import concurrent.futures as futures
import logging
import multiprocessing as mp
import os
import signal
import threading
import time

from megatron_async_rl.rewards.isolated import RewardTimeoutError

logger = logging.getLogger(__name__)


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank handles Ctrl-C
    import math_verify  # noqa: F401 - imported once per worker, not per answer


def _grade(response: str, answer: str) -> bool:
    from megatron_async_rl.rewards.math_grade import grade

    return grade(response, answer)


class GradePool:
    """`grade_many(pairs)` -> one bool (or exception) per (response, answer), graded by
    `workers` processes, each answer within `call_timeout_s` of the batch's start."""

    def __init__(self, workers: int = 2, call_timeout_s: float = 30.0):
        self.workers, self.call_timeout_s = workers, call_timeout_s
        self._pool: futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = futures.ProcessPoolExecutor(
                self.workers, mp_context=mp.get_context("spawn"), initializer=_init_worker
            )
        return self._pool

    def grade_many(self, pairs: list[tuple[str, str]]) -> list[bool | Exception]:
        if not pairs:
            return []
        with self._lock:  # one batch at a time; a replaced pool is not shared mid-batch
            pool = self._executor()
            jobs = [pool.submit(_grade, response, answer) for response, answer in pairs]
            deadline = time.monotonic() + self.call_timeout_s
            out: list[bool | Exception] = []
            stuck = False
            for job in jobs:
                try:
                    out.append(job.result(timeout=max(0.0, deadline - time.monotonic())))
                except futures.TimeoutError:
                    stuck = True
                    out.append(RewardTimeoutError(
                        f"Math-Verify did not grade within {self.call_timeout_s:g} s"
                    ))  # fmt: skip
                except Exception as err:  # noqa: BLE001 - reported per answer by SafeReward
                    out.append(err)
            if stuck:
                self._replace()
            return out

    def _replace(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError, TypeError):
                pass
        logger.warning("math reward: a Math-Verify worker did not answer within %g s; the "
                       "pool was replaced", self.call_timeout_s)  # fmt: skip

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
