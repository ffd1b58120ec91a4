"""A reward function run in a child process, so that a call that hangs can be cut.

Owned here: `IsolatedReward`, what `rewards.registry.SafeReward` calls when the recipe sets
`reward.call_timeout_s`. One child process (spawned on first use, and again after a cut) builds
the reward from the same `RewardConfig` (with `build`, the registry's `get_reward`, passed in so
that this module imports nothing of the package) and answers one call at a time over a pipe. A
call that does not answer within `call_timeout_s` raises `RewardTimeoutError`: the child is
killed (a Python thread cannot be), the sample scores 0 and is counted (`reward/timeouts`), and
the next call starts a new child. An exception in the reward comes back as a `RuntimeError` carrying
its type and message; a child that dies (e.g. a segfault in a native library) likewise.
Without `call_timeout_s` the reward runs in the rank's own process (no pipe, no bound).

Not `worker_pool.WorkerPool`: this is one process per reward with its own restart count, fed
one call at a time; the pool shares workers between callers' batches and replaces all of them
when one call is cut.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time

logger = logging.getLogger(__name__)

FAULT_KEY = "__megatron_async_rl_fault__"
"""Metadata key of an injected reward hang: the isolated reward's child sleeps on it."""


class RewardTimeoutError(TimeoutError):
    """One reward call did not answer within `reward.call_timeout_s` (scored 0, counted)."""


def _serve(conn, config, build) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank handles interrupts
    fn = build(config)
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):  # the rank is gone
            return
        try:
            if isinstance(args[2], dict) and args[2].get(FAULT_KEY) == "hang":
                time.sleep(10**6)  # an injected hang (faults.reward_hang_steps): cut by the rank
            conn.send(("ok", fn(*args)))
        except Exception as err:  # noqa: BLE001 - reported to the rank, which scores 0
            conn.send(("error", f"{type(err).__name__}: {err}"))


class IsolatedReward:
    """`fn(response_text, answer, metadata)` of the reward `config` names, in a child process
    (`build(config)` there makes it: a module-level function, pickled by name)."""

    def __init__(self, config, call_timeout_s: float, build):
        self.config, self.call_timeout_s, self.build = config, call_timeout_s, build
        self.name = config.name
        self._proc = self._conn = None
        self.restarts = 0

    def __call__(self, response_text: str, answer: str, metadata: dict) -> float:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((response_text, answer, metadata))
        if not self._conn.poll(self.call_timeout_s):
            self.close()
            raise RewardTimeoutError(
                f"reward {self.name} did not answer within reward.call_timeout_s = "
                f"{self.call_timeout_s:g} s (its process was killed; the next call starts one)"
            )
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            code = self._proc.exitcode
            self.close()
            raise RuntimeError(f"reward {self.name}: its process died (exit code {code})") from None
        if kind == "error":
            raise RuntimeError(value)
        return value

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.config, self.build), daemon=True,
                                 name=f"reward-{self.name}")  # fmt: skip
        start = time.monotonic()
        self._proc.start()
        child.close()
        self.restarts += 1
        logger.info("reward %s: child process %d started in %.2f s", self.name, self._proc.pid,
                    time.monotonic() - start)  # fmt: skip

    def close(self) -> None:
        """Kill the child (a hung reward does not stop by itself)."""
        if self._proc is not None:
            if self._proc.is_alive():
                os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.join(10)
            self._conn.close()
        self._proc = self._conn = None
