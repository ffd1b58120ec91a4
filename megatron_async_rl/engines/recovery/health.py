"""An engine's health state and its restart budget: pure, no process, no sglang.

Owned here: `EngineHealth` (the lifecycle below, an explicit transition table, one `transition`
that rejects an illegal move naming the engine, the states and the reason) and `RestartBudget`
(how many restarts an engine may take per window of steps; past it, `EngineRestartLimitError`
names the engine, its rank, every cause and the counts). Used by `engines.recovery.restarting`.

    HEALTHY --probe failed--> SUSPECT --probe failed again / call saw it die--> DEAD
       ^                          |                                              |
       |                          +--probe answered--> HEALTHY                   v
       +------ STALE <---new process up, no weights yet--- RESTARTING <----------+
         (weights of the newest complete version loaded: takes traffic again)

A restarted engine takes no request while STALE: it serves the weights it started from (the
model on disk), not the run's current version, until those are loaded.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class EngineHealth(enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"
    RESTARTING = "restarting"
    STALE = "stale"


_ALLOWED: dict[EngineHealth, tuple[EngineHealth, ...]] = {
    EngineHealth.HEALTHY: (EngineHealth.SUSPECT, EngineHealth.DEAD),
    EngineHealth.SUSPECT: (EngineHealth.HEALTHY, EngineHealth.DEAD),
    EngineHealth.DEAD: (EngineHealth.RESTARTING,),
    # A restart that fails (the new process does not come up) is dead again.
    EngineHealth.RESTARTING: (EngineHealth.STALE, EngineHealth.DEAD),
    EngineHealth.STALE: (EngineHealth.HEALTHY, EngineHealth.DEAD),
}


class EngineRestartLimitError(RuntimeError):
    """An engine failed more often than `engine.max_restarts` allows: the run stops."""


def transition(where: str, current: EngineHealth, new: EngineHealth, reason: str) -> EngineHealth:
    """`new`, if the lifecycle allows `current -> new`; else RuntimeError naming all of it."""
    if new not in _ALLOWED[current]:
        raise RuntimeError(
            f"engine [{where}]: illegal health transition {current.value} -> {new.value} "
            f"({reason}); allowed from {current.value}: "
            f"{[s.value for s in _ALLOWED[current]] or 'none'}"
        )
    return new


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts within any `window_steps` consecutive steps."""

    where: str
    max_restarts: int
    window_steps: int

    def __post_init__(self) -> None:
        self.causes: list[tuple[int, str]] = []  # (step, cause) of every failure seen
        self._recent: deque[int] = deque()

    def charge(self, step: int, cause: str) -> None:
        """Record a failure at `step`; raise `EngineRestartLimitError` if restarting it would
        exceed the budget (the error lists every cause with its step)."""
        self.causes.append((step, cause))
        while self._recent and self._recent[0] <= step - self.window_steps:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            listed = "; ".join(f"step {s}: {c}" for s, c in self.causes)
            raise EngineRestartLimitError(
                f"engine [{self.where}] failed {len(self.causes)} time(s) in all, "
                f"{len(self._recent) + 1} within the last {self.window_steps} step(s), "
                f"more than engine.max_restarts = {self.max_restarts} allows; causes: {listed}"
            )
        self._recent.append(step)
