"""Faults injected on purpose outside the engine: weight messages, rewards, whole ranks.

Owned here: `RankFaults`, built by `jobs/parts.py` from the recipe's `faults:` section
(`engines.config.FaultsConfig`, refused without `faults.allow: true`; the engine's own faults are
`engines/recovery/faults.py`'s). Each fault goes through the real recovery path:
- `weight_corrupt_versions`: `tamper` flips one payload byte of the first message an engine
  host receives of that version, on the first attempt only, before its checks: the checksum
  fails and the sync sends the version again (`weight_sync.max_attempts`);
- `reward_hang_steps` / `reward_raise_steps`: `reward_fault(step)` marks the step's first
  reward call to hang in the reward's child process (cut by `reward.call_timeout_s`) or to raise
  (scored 0 and counted, or the run stops with `reward.on_failure: stop`);
- `rank_kill_steps`: `at_step(step)` SIGKILLs global rank `rank_kill_rank` as its step begins,
  on the launcher's first attempt only (`TORCHELASTIC_RESTART_COUNT` 0): the peers' collectives
  fail, named, and `torchrun --max-restarts` restarts the world, which resumes from the newest
  checkpoint.
With several engines, the faults of step (version) k go to engine `k % num_engines` only.
Counted as `faults/injected/<kind>`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from megatron_async_rl.engines.config import FaultsConfig
from megatron_async_rl.weight_sync.plan import HEADER_BYTES

logger = logging.getLogger(__name__)


class RankFaults:
    """The faults of one rank: `tamper`, `reward_fault`, `at_step`; `take_metrics`."""

    def __init__(self, cfg: FaultsConfig, rank: int, engine_index: int | None = None,
                 num_engines: int = 1, attempt: int | None = None):  # fmt: skip
        """`engine_index`: this rank's engine among `num_engines` (None: no engine here).
        `attempt`: the launcher's restart count (default: `TORCHELASTIC_RESTART_COUNT`)."""
        self.cfg, self.rank = cfg, rank
        self.engine_index, self.num_engines = engine_index, num_engines
        if attempt is None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.attempt = attempt
        self.done: set[tuple[str, int]] = set()
        self.counts: dict[str, float] = {}
        self._lock = threading.Lock()

    def _mine(self, k: int) -> bool:
        return self.engine_index is not None and k % self.num_engines == self.engine_index

    def _once(self, kind: str, k: int) -> bool:
        with self._lock:
            if (kind, k) in self.done:
                return False
            self.done.add((kind, k))
            key = f"faults/injected/{kind}"
            self.counts[key] = self.counts.get(key, 0.0) + 1
            return True

    def tamper(self, view, version: int, seq: int) -> None:
        """`executor.run_plan`'s hook: corrupt a due version's first message once."""
        due = version in self.cfg.weight_corrupt_versions and self._mine(version)
        if not due or not self._once("weight_corrupt", version):
            return
        index = min(HEADER_BYTES, view.numel() - 1)
        view[index] = view[index] ^ 0xFF
        logger.warning("fault injection: weight v%d message %d corrupted on arrival (byte %d)",
                       version, seq, index)  # fmt: skip

    def reward_fault(self, step: int) -> str | None:
        """'hang', 'raise' or None: what the step's first reward call does (once per step)."""
        if not self._mine(step):
            return None
        for kind, steps in (("hang", self.cfg.reward_hang_steps),
                            ("raise", self.cfg.reward_raise_steps)):  # fmt: skip
            if step in steps and self._once(f"reward_{kind}", step):
                logger.warning("fault injection: the first reward call of step %d will %s",
                               step, kind)  # fmt: skip
                return kind
        return None

    def at_step(self, step: int) -> None:
        """SIGKILL this rank if the recipe asks for it at `step` (first attempt only)."""
        cfg = self.cfg
        if self.attempt or self.rank != cfg.rank_kill_rank or step not in cfg.rank_kill_steps:
            return
        logger.warning("fault injection: global rank %d kills itself (SIGKILL) at step %d",
                       self.rank, step)  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def take_metrics(self) -> dict[str, float]:
        with self._lock:
            out, self.counts = self.counts, {}
        return out
