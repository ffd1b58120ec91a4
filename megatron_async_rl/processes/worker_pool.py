"""Worker processes that run calls which may hang, each bounded in time, for the rollout side.

Owned here: `WorkerPool`, a `concurrent.futures.ProcessPoolExecutor` of spawned workers
(SIGINT ignored: the rank handles Ctrl-C; each ends when the rank is gone) whose `run_many`
returns one result or exception per call, for callers on many threads at once (their calls
share the workers, each sent when a worker is free). A call that does not answer within
`call_timeout_s` of being sent comes back as `CallTimeout` (a `TimeoutError`), and the pool
is replaced: its workers are killed (a thread cannot be), so one call cannot stall its stage;
other callers' calls that were on it run again on the new pool.
Used by the `math` reward's Math-Verify graders (`rewards/math_pool.py`) and by tool calls
(`rollout/tools.py`). The pool starts at the first call. The target must be a module-level
function (it is pickled by name).
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool

logger = logging.getLogger(__name__)


class CallTimeout(TimeoutError):
    """A call did not answer within the pool's `call_timeout_s`."""


def _worker_start(parent: int, init: Callable[[], None] | None) -> None:
    """In each worker: ignore Ctrl-C (the rank handles it), end when the rank is gone (a rank
    that stopped with `os._exit`, or was killed, never shuts its pool down, and a worker blocked
    on the call queue would wait forever), then the target's own set-up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if init is not None:
        init()


class WorkerPool:
    """`run_many(target, arg_tuples)` -> one result (or exception) per call, run by
    `workers` processes, each within `call_timeout_s` of the batch's start."""

    def __init__(self, workers: int = 2, call_timeout_s: float = 30.0, what: str = "call",
                 initializer: Callable[[], None] | None = None):  # fmt: skip
        self.workers, self.call_timeout_s, self.what = workers, call_timeout_s, what
        self.initializer = initializer
        self._pool: futures.ProcessPoolExecutor | None = None
        self._slots = threading.Semaphore(workers)
        """One per worker: a call is sent only when a worker is free for it."""
        self._generation = 0
        """Counts replacements: a caller replaces only the pool its own calls ran on."""
        self._lock = threading.Lock()

    def _executor(self) -> futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = futures.ProcessPoolExecutor(
                self.workers, mp_context=mp.get_context("spawn"),
                initializer=_worker_start, initargs=(os.getpid(), self.initializer),
            )  # fmt: skip
        return self._pool

    def run_many(self, target: Callable, calls: list[tuple]) -> list:
        """Callers on several threads share the workers (a step's tool calls of every
        trajectory run at once). A call waits for a free worker before it is sent, so its
        `call_timeout_s` counts its own run, not its wait behind others. A call whose pool
        another caller replaced (a call of its timed out) is sent again, up to three times."""
        if not calls:
            return []
        out: list = [None] * len(calls)
        pending = collections.deque((i, 0) for i in range(len(calls)))  # (call, tries)
        running: dict = {}  # future -> (call, tries, deadline, pool generation)
        while pending or running:
            while pending and self._slots.acquire(blocking=not running):
                i, tries = pending.popleft()
                with self._lock:  # the pool in use now; replacing it also takes the lock
                    pool, generation = self._executor(), self._generation
                    job = pool.submit(target, *calls[i])
                deadline = time.monotonic() + self.call_timeout_s
                running[job] = (i, tries, deadline, generation)
            now = time.monotonic()
            wait_s = max(0.0, min(d for _, _, d, _ in running.values()) - now)
            done, _ = futures.wait(running, timeout=wait_s, return_when=futures.FIRST_COMPLETED)
            now = time.monotonic()
            for job in list(running):
                i, tries, deadline, generation = running[job]
                if job not in done and now < deadline:
                    continue
                del running[job]
                self._slots.release()
                if job not in done:
                    out[i] = CallTimeout(
                        f"{self.what} did not answer within {self.call_timeout_s:g} s"
                    )  # fmt: skip
                    with self._lock:
                        if self._generation == generation:  # not replaced by another caller
                            self._replace()
                    continue
                try:
                    out[i] = job.result()
                except (BrokenProcessPool, futures.CancelledError):
                    if tries < 2:  # its pool was replaced under it: send it again
                        pending.append((i, tries + 1))
                    else:
                        out[i] = CallTimeout(f"{self.what}: its workers were replaced 3 times")
                except Exception as err:  # noqa: BLE001 - reported per call
                    out[i] = err
        return out

    def _replace(self) -> None:
        pool, self._pool = self._pool, None
        self._generation += 1
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError, TypeError):
                pass
        logger.warning("%s: a worker did not answer within %g s; the pool was replaced",
                       self.what, self.call_timeout_s)  # fmt: skip

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
