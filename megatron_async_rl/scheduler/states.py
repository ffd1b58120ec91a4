"""The states of a pipeline stage, every legal move between them, and the scheduler's errors.

Owned here: `StageState`, the `Stage` names, one explicit transition table per stage
(`TRANSITIONS`), `IllegalTransition` (a move the table forbids) and `StageTimeout` (a wait that
ran out of time). `machine.StageMachine` enforces the tables; `queues.BoundedQueue` raises
`StageTimeout`. Pure: no torch, no process groups, so it is tested alone.

The tables are written out state by state, so every legal move can be read here. Only the
scheduler moves a machine; a move not in its stage's table is a bug in the scheduler, reported
with stage, from, to and why.

Stages (design.md, section 3): `dataloader -> generate -> reward -> logp -> ref_logp -> train ->
param_update`, plus `validation` and `checkpoint`; with the optional roles (PPO), `reward_model`
(its scores) and `critic_values` after `ref_logp`, and `critic_train` after `train`, each on its
role's own ranks. Advantages (GRPO's or GAE's) are computed where `train` takes its batch, as in
the synchronous loop (`jobs/grpo_sync.py`), so they are not a stage of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any


class StageState(Enum):
    """Where one stage's machine is. Time in RUNNING is busy; time in a WAITING_* state or in
    PAUSED is idle (a bubble); IDLE is between items and counts as neither."""

    IDLE = "idle"
    WAITING_INPUT = "waiting_input"
    RUNNING = "running"
    WAITING_OUTPUT_SPACE = "waiting_output_space"
    PAUSED = "paused"
    ERROR = "error"
    DONE = "done"


class Stage(str, Enum):
    """A stage of the pipeline; the value is the name used in logs and metrics keys."""

    DATALOADER = "dataloader"
    GENERATE = "generate"
    REWARD = "reward"
    LOGP = "logp"
    REF_LOGP = "ref_logp"
    REWARD_MODEL = "reward_model"
    CRITIC_VALUES = "critic_values"
    TRAIN = "train"
    CRITIC_TRAIN = "critic_train"
    PARAM_UPDATE = "param_update"
    VALIDATION = "validation"
    CHECKPOINT = "checkpoint"


S = StageState
TERMINAL = frozenset({S.ERROR, S.DONE})
"""No move leaves these: an ERROR ends the run (no retry), DONE ends the stage."""

Table = Mapping[StageState, frozenset[StageState]]

BASE_TABLE: Table = {
    # Between items. RUNNING directly when the input is already there; DONE at the end of the run.
    S.IDLE: frozenset({S.WAITING_INPUT, S.RUNNING, S.DONE, S.ERROR}),
    # Upstream queue empty (or, for generate, weights too old to admit the next step).
    # DONE when the upstream queue is closed and drained.
    S.WAITING_INPUT: frozenset({S.RUNNING, S.DONE, S.ERROR}),
    # Computing one item. IDLE when the result was handed on at once.
    S.RUNNING: frozenset({S.WAITING_OUTPUT_SPACE, S.IDLE, S.ERROR}),
    # Holding a result while the downstream queue is full (back-pressure).
    S.WAITING_OUTPUT_SPACE: frozenset({S.IDLE, S.ERROR}),
    S.PAUSED: frozenset(),
    S.ERROR: frozenset(),
    S.DONE: frozenset(),
}
"""dataloader, reward, logp, ref_logp, reward_model, critic_values, train, critic_train."""

GENERATE_TABLE: Table = {
    S.IDLE: frozenset({S.WAITING_INPUT, S.RUNNING, S.DONE, S.ERROR}),
    S.WAITING_INPUT: frozenset({S.RUNNING, S.DONE, S.ERROR}),
    # PAUSED: an in-flight weight update stops the engines in place (weight_update_mode in_flight).
    S.RUNNING: frozenset({S.WAITING_OUTPUT_SPACE, S.IDLE, S.PAUSED, S.ERROR}),
    S.WAITING_OUTPUT_SPACE: frozenset({S.IDLE, S.ERROR}),
    # The new weights are loaded: the same requests continue; later tokens carry the new version.
    S.PAUSED: frozenset({S.RUNNING, S.ERROR}),
    S.ERROR: frozenset(),
    S.DONE: frozenset(),
}
"""generate: the base table plus RUNNING -> PAUSED -> RUNNING."""

PARAM_UPDATE_TABLE: Table = {
    S.IDLE: frozenset({S.WAITING_INPUT, S.DONE, S.ERROR}),
    # Waiting for train to publish a new version. RUNNING at once when the engines can take it.
    S.WAITING_INPUT: frozenset({S.WAITING_OUTPUT_SPACE, S.RUNNING, S.DONE, S.ERROR}),
    # The engines are the output: waiting for them to finish their batch (mode wait) or to pause
    # in place (mode in_flight), and for validation of the current version to finish.
    S.WAITING_OUTPUT_SPACE: frozenset({S.RUNNING, S.ERROR}),
    # Gather, send, load; then IDLE until the next version.
    S.RUNNING: frozenset({S.IDLE, S.ERROR}),
    S.PAUSED: frozenset(),
    S.ERROR: frozenset(),
    S.DONE: frozenset(),
}
"""param_update: the output wait (engines ready to load) comes before the work, not after."""

VALIDATION_TABLE: Table = {
    S.IDLE: frozenset({S.WAITING_INPUT, S.RUNNING, S.DONE, S.ERROR}),
    # Waiting for the engines to hold the version to evaluate.
    S.WAITING_INPUT: frozenset({S.RUNNING, S.DONE, S.ERROR}),
    # Results go to the metrics writer, which never blocks: no output wait.
    S.RUNNING: frozenset({S.IDLE, S.ERROR}),
    S.WAITING_OUTPUT_SPACE: frozenset(),
    S.PAUSED: frozenset(),
    S.ERROR: frozenset(),
    S.DONE: frozenset(),
}
"""validation: IDLE -> (WAITING_INPUT ->) RUNNING -> IDLE; checkpoint (an engine host's save in
the asynchronous loop: waiting for the version to save, then writing) moves the same way."""

TRANSITIONS: dict[Stage, Table] = {
    Stage.DATALOADER: BASE_TABLE,
    Stage.GENERATE: GENERATE_TABLE,
    Stage.REWARD: BASE_TABLE,
    Stage.LOGP: BASE_TABLE,
    Stage.REF_LOGP: BASE_TABLE,
    Stage.REWARD_MODEL: BASE_TABLE,
    Stage.CRITIC_VALUES: BASE_TABLE,
    Stage.TRAIN: BASE_TABLE,
    Stage.CRITIC_TRAIN: BASE_TABLE,
    Stage.PARAM_UPDATE: PARAM_UPDATE_TABLE,
    Stage.VALIDATION: VALIDATION_TABLE,
    Stage.CHECKPOINT: VALIDATION_TABLE,
}


def check_table(table: Table) -> None:
    """Raise ValueError unless `table` names every state, moves only to states, never to the
    same state, and lets every non-terminal state fail to ERROR."""
    missing = [s.name for s in StageState if s not in table]
    if missing:
        raise ValueError(f"transition table lacks states {missing}: list every state explicitly")
    for src, targets in table.items():
        if src in targets:
            raise ValueError(f"transition table: {src.name} -> {src.name} (self-move)")
        if src in TERMINAL and targets:
            raise ValueError(f"transition table: {src.name} is terminal but has moves")
        if targets and S.ERROR not in targets:
            raise ValueError(f"transition table: {src.name} cannot move to ERROR")


for _table in (BASE_TABLE, GENERATE_TABLE, PARAM_UPDATE_TABLE, VALIDATION_TABLE):
    check_table(_table)


class IllegalTransition(RuntimeError):
    """A move its stage's table forbids: a scheduler bug, never a user's mistake."""

    def __init__(
        self,
        stage: str,
        from_state: StageState,
        to_state: StageState,
        reason: str,
        requested_for: str = "",
    ):
        self.stage = stage
        self.from_state = from_state
        self.to_state = to_state
        self.reason = reason
        self.requested_for = requested_for
        message = (
            f"stage {stage}: illegal transition {from_state.name} -> {to_state.name} ({reason})"
        )
        if requested_for:
            message += f"; requested for: {requested_for}"
        super().__init__(message)

    def __reduce__(self):
        # Rebuilt from the fields when pickled (errors may cross process boundaries).
        args = (self.stage, self.from_state, self.to_state, self.reason, self.requested_for)
        return (IllegalTransition, args)


def why_illegal(table: Table, from_state: StageState, to_state: StageState) -> str:
    """The rule a forbidden move breaks, in words."""
    if from_state in TERMINAL:
        return f"{from_state.name} is terminal"
    if from_state == to_state:
        return f"already {from_state.name}"
    allowed = sorted(s.name for s in table[from_state])
    if not allowed:
        return f"this stage never enters {from_state.name}"
    return f"{from_state.name} may move only to {', '.join(allowed)}"


CONTEXT_KEYS = ("role", "rank", "stage", "state")


class StageTimeout(RuntimeError):
    """A wait that ran past its timeout (`scheduler.stage_timeout_s`): who waited (role, rank,
    stage, state, from `context`), for what, and for how long. Every wait has a timeout, so a
    stuck peer ends the run with this message instead of a hang."""

    def __init__(
        self,
        waiting_for: str,
        waited_s: float,
        timeout_s: float,
        context: Mapping[str, Any] | None = None,
        queue: str | None = None,
    ):
        self.waiting_for = waiting_for
        self.waited_s = waited_s
        self.timeout_s = timeout_s
        self.context = dict(context or {})
        self.queue = queue
        who = [f"{key} {self.context.get(key, '?')}" for key in CONTEXT_KEYS]
        who += [f"{key} {value}" for key, value in self.context.items() if key not in CONTEXT_KEYS]
        super().__init__(
            f"{', '.join(who)}: timed out after {waited_s:.3g} s (timeout {timeout_s:g} s) "
            f"waiting for {waiting_for}; the stage on the other side is stuck or too slow "
            f"(raise scheduler.stage_timeout_s if it is only slow)"
        )

    def __reduce__(self):
        args = (self.waiting_for, self.waited_s, self.timeout_s, self.context, self.queue)
        return (StageTimeout, args)
