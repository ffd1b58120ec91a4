"""One stage's state machine: its state, every move it made, and where its time went.

Owned here: `StageMachine`. The scheduler thread of a rank moves the machines of the stages that
run there (`transition`, `fail`); the main thread reads their metrics and spans while they run,
so every method takes the machine's lock.

Lifecycle (per-stage tables in `states.py`)::

           +--------------------------------------------------------------+
           v                                                              |
         IDLE ---> WAITING_INPUT ---> RUNNING ---> WAITING_OUTPUT_SPACE --+
          |  |           |             ^  |  |  ^
          |  +-----------|-------------+  |  v  |
          |    input     |  ready         | PAUSED  (generate: in-place weight update)
          +---> DONE <---+                +--> IDLE (result handed on at once)
          (end of run, or upstream closed and drained)

    any non-terminal state --fail()--> ERROR          (DONE and ERROR are terminal)

    param_update  IDLE -> WAITING_INPUT -> WAITING_OUTPUT_SPACE -> RUNNING -> IDLE
                  (new version ready -> engines drained or paused -> gather/send/load)
    validation    IDLE -> WAITING_INPUT -> RUNNING -> IDLE  (results never wait for space)

Time accounting: RUNNING is busy; WAITING_INPUT, WAITING_OUTPUT_SPACE and PAUSED are idle (the
bubbles the async pipeline exists to shrink); IDLE is bookkeeping between items and is neither.

The machines are the one clock of a run: every finished span goes to the machine's `observer`
(with the step of the item it belonged to), which `observability/clock.py` turns into the trace,
the `utilization/*` metrics and `timing/<stage>_s`, so those views agree by construction.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from megatron_async_rl.scheduler.states import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Stage,
    StageState,
    Table,
    check_table,
    why_illegal,
)

BUSY_STATES = frozenset({StageState.RUNNING})
IDLE_STATES = frozenset(
    {StageState.WAITING_INPUT, StageState.WAITING_OUTPUT_SPACE, StageState.PAUSED}
)
DEFAULT_MAX_HISTORY = 4096
"""Moves (and spans) kept per machine; about eight per step, so the last ~500 steps."""


class Move(NamedTuple):
    """One transition: when (on the machine's clock), from, to, and why it was made."""

    time: float
    from_state: StageState
    to_state: StageState
    reason: str


class Span(NamedTuple):
    """A stretch of time spent in one state, for traces (Chrome/Perfetto) and timelines."""

    state: StageState
    start: float
    end: float
    step: int | None = None
    """The step of the item the machine worked on or waited for (None: not known)."""


SpanObserver = Callable[[Stage, Span], None]
"""Told of every finished span, outside the machine's lock, in the order they end."""


class StageMachine:
    """The state of one stage, moved only through its transition table.

    Args:
        stage: the stage's name (a `Stage` or its string value).
        table: the legal moves; default: the stage's table in `states.TRANSITIONS`.
        clock: seconds, monotonic; tests pass a fake.
        max_history: how many moves and spans to keep (older ones are dropped; the busy and
            idle totals keep counting).
        observer: told of every finished span (see `SpanObserver`).
    """

    def __init__(
        self,
        stage: Stage | str,
        table: Table | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_history: int = DEFAULT_MAX_HISTORY,
        observer: SpanObserver | None = None,
    ):
        self.stage = Stage(stage)
        self.table = TRANSITIONS[self.stage] if table is None else table
        check_table(self.table)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = StageState.IDLE
        self._since = clock()
        self._seconds = dict.fromkeys(StageState, 0.0)
        self._history: deque[Move] = deque(maxlen=max_history)
        self._spans: deque[Span] = deque(maxlen=max_history)
        self._step: int | None = None
        self._observer = observer
        self.error: BaseException | None = None
        """The exception passed to `fail`, if any."""

    @property
    def state(self) -> StageState:
        with self._lock:
            return self._state

    @property
    def is_terminal(self) -> bool:
        with self._lock:
            return self._state in TERMINAL

    def transition(self, to: StageState, reason: str, *, step: int | None = None) -> None:
        """Move to `to`; `reason` says why (kept in the history); `step`, when given, is the
        step of the item the machine works on from now on (its spans carry it). Raises
        IllegalTransition, leaving the machine unchanged, when the stage's table forbids it."""
        self._move(to, reason, None, step)

    def fail(self, error: BaseException) -> None:
        """Move to ERROR from any non-terminal state and keep `error`. Raises IllegalTransition
        from DONE or ERROR: both are terminal (the first error is the one kept)."""
        self._move(StageState.ERROR, f"{type(error).__name__}: {error}", error, None)

    def _move(
        self, to: StageState, reason: str, error: BaseException | None, step: int | None
    ) -> None:
        with self._lock:
            src = self._state
            if to not in self.table[src]:
                raise IllegalTransition(
                    self.stage.value, src, to, why_illegal(self.table, src, to), reason
                )
            now = self._clock()
            self._seconds[src] += now - self._since
            span = Span(src, self._since, now, self._step)
            self._spans.append(span)
            self._history.append(Move(now, src, to, reason))
            self._state, self._since = to, now
            if step is not None:
                self._step = step
            if error is not None:
                self.error = error
        if self._observer is not None:
            self._observer(self.stage, span)

    def seconds_in(self, state: StageState) -> float:
        """Total seconds spent in `state`, including the current stretch if it is the state."""
        with self._lock:
            return self._seconds_in(state, self._clock())

    def _seconds_in(self, state: StageState, now: float) -> float:
        current = now - self._since if state == self._state else 0.0
        return self._seconds[state] + current

    @property
    def busy_s(self) -> float:
        """Seconds in RUNNING."""
        return self.seconds_in(StageState.RUNNING)

    @property
    def idle_s(self) -> float:
        """Seconds waiting: WAITING_INPUT, WAITING_OUTPUT_SPACE and PAUSED."""
        with self._lock:
            now = self._clock()
            return sum(self._seconds_in(s, now) for s in IDLE_STATES)

    def history(self) -> list[Move]:
        """The kept moves, oldest first."""
        with self._lock:
            return list(self._history)

    def spans(self, include_current: bool = False) -> list[Span]:
        """The kept finished spans, oldest first; with `include_current`, also the stretch in
        the current state up to now."""
        with self._lock:
            spans = list(self._spans)
            if include_current:
                spans.append(Span(self._state, self._since, self._clock(), self._step))
            return spans

    def context(self) -> dict[str, str]:
        """Who is waiting, for a `StageTimeout` (the caller adds role and rank)."""
        with self._lock:
            return {"stage": self.stage.value, "state": self._state.name}

    def metrics(self, prefix: str = "scheduler") -> dict[str, float]:
        """`<prefix>/<stage>/busy_s`, `idle_s`, and `in_<state>_s` for each non-terminal state
        (`in_idle_s`, `in_paused_s`, ...): seconds since the machine was created."""
        with self._lock:
            now = self._clock()
            seconds = {s: self._seconds_in(s, now) for s in StageState}
        base = f"{prefix}/{self.stage.value}"
        out = {f"{base}/busy_s": sum(seconds[s] for s in BUSY_STATES)}
        out[f"{base}/idle_s"] = sum(seconds[s] for s in IDLE_STATES)
        out.update({f"{base}/in_{s.value}_s": v for s, v in seconds.items() if s not in TERMINAL})
        return out

    def __repr__(self) -> str:
        return f"StageMachine({self.stage.value}, {self.state.name})"
