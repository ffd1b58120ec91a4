"""Stage states and machines (`scheduler.states`, `scheduler.machine`).

Contract checked: every move in every stage's transition table is accepted and recorded; every
move outside it, from every state the stage can reach, raises IllegalTransition naming stage,
from, to and why, and leaves the machine unchanged; `fail` reaches ERROR from every non-terminal
state and nowhere else; DONE and ERROR are terminal; a malformed table is refused; the errors
survive pickling. Time accounting: `test_scheduler_machine.py`. Faked: the clock only.
"""

import pickle
from collections import deque

import pytest

from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.states import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Stage,
    StageState,
    StageTimeout,
    check_table,
    why_illegal,
)
from tests.harness.clocks import FakeClock

S = StageState


def path_to(stage: Stage, target: StageState) -> list[StageState] | None:
    """Shortest list of moves from IDLE to `target` in the stage's table (None: unreachable)."""
    table, parents, todo = TRANSITIONS[stage], {S.IDLE: None}, deque([S.IDLE])
    while todo:
        state = todo.popleft()
        for nxt in sorted(table[state], key=lambda s: s.name):
            if nxt not in parents:
                parents[nxt] = state
                todo.append(nxt)
    if target not in parents:
        return None
    path = [target]
    while parents[path[-1]] is not None:
        path.append(parents[path[-1]])
    return path[::-1][1:]


def machine_in(stage: Stage, state: StageState, clock=None) -> StageMachine:
    machine = StageMachine(stage, clock=clock or FakeClock())
    for step in path_to(stage, state):
        machine.transition(step, "test setup")
    assert machine.state == state
    return machine


def reachable(stage: Stage) -> list[StageState]:
    return [s for s in StageState if path_to(stage, s) is not None]


LEGAL = [
    pytest.param(stage, src, dst, id=f"{stage.value}-{src.name}-{dst.name}")
    for stage, table in TRANSITIONS.items()
    for src in StageState
    for dst in sorted(table[src], key=lambda s: s.name)
]
ILLEGAL = [
    pytest.param(stage, src, dst, id=f"{stage.value}-{src.name}-{dst.name}")
    for stage, table in TRANSITIONS.items()
    for src in reachable(stage)
    for dst in StageState
    if dst not in table[src]
]


def test_every_stage_has_a_table():
    assert set(TRANSITIONS) == set(Stage)
    assert [s.value for s in Stage] == [
        "dataloader", "generate", "reward", "logp", "ref_logp", "reward_model", "critic_values",
        "train", "critic_train", "param_update", "validation", "checkpoint",
    ]  # fmt: skip


BASE = (
    "IDLE: WAITING_INPUT RUNNING DONE | WAITING_INPUT: RUNNING DONE"
    " | RUNNING: WAITING_OUTPUT_SPACE IDLE | WAITING_OUTPUT_SPACE: IDLE"
)
EXPECTED = {
    "dataloader": BASE,
    "generate": "IDLE: WAITING_INPUT RUNNING DONE | WAITING_INPUT: RUNNING DONE"
    " | RUNNING: WAITING_OUTPUT_SPACE IDLE PAUSED | WAITING_OUTPUT_SPACE: IDLE | PAUSED: RUNNING",
    "reward": BASE,
    "logp": BASE,
    "ref_logp": BASE,
    "reward_model": BASE,
    "critic_values": BASE,
    "train": BASE,
    "critic_train": BASE,
    "param_update": "IDLE: WAITING_INPUT DONE | WAITING_INPUT: WAITING_OUTPUT_SPACE RUNNING DONE"
    " | WAITING_OUTPUT_SPACE: RUNNING | RUNNING: IDLE",
    "validation": "IDLE: WAITING_INPUT RUNNING DONE | WAITING_INPUT: RUNNING DONE | RUNNING: IDLE",
    "checkpoint": "IDLE: WAITING_INPUT RUNNING DONE | WAITING_INPUT: RUNNING DONE | RUNNING: IDLE",
}
"""The design's moves, written independently of `states.py` (ERROR is added to every source)."""


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_table_is_the_designed_one(stage):
    expected = {s: set() for s in StageState}
    for part in EXPECTED[stage.value].split(" | "):
        src, targets = part.split(": ")
        expected[S[src]] = {S[t] for t in targets.split()} | {S.ERROR}
    assert {src: set(dst) for src, dst in TRANSITIONS[stage].items()} == expected


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_every_used_state_is_reachable_and_can_fail(stage):
    table = TRANSITIONS[stage]
    used = {s for s, targets in table.items() if targets} | {t for ts in table.values() for t in ts}
    assert used <= set(reachable(stage))
    for state in used - TERMINAL:
        assert S.ERROR in table[state]


@pytest.mark.parametrize("stage,src,dst", LEGAL)
def test_legal_transition(stage, src, dst):
    clock = FakeClock()
    machine = machine_in(stage, src, clock)
    clock.advance(1.5)
    machine.transition(dst, "because the test says so")
    assert machine.state == dst
    move = machine.history()[-1]
    assert (move.time, move.from_state, move.to_state) == (clock.now, src, dst)
    assert move.reason == "because the test says so"
    assert machine.spans()[-1] == (src, clock.now - 1.5, clock.now, None)


@pytest.mark.parametrize("stage,src,dst", ILLEGAL)
def test_illegal_transition(stage, src, dst):
    machine = machine_in(stage, src)
    before = machine.history()
    pattern = rf"^stage {stage.value}: illegal transition {src.name} -> {dst.name} \(.+\)"
    with pytest.raises(IllegalTransition, match=pattern) as info:
        machine.transition(dst, "test")
    err = info.value
    assert (err.stage, err.from_state, err.to_state) == (stage.value, src, dst)
    assert err.reason == why_illegal(TRANSITIONS[stage], src, dst)
    assert machine.state == src and machine.history() == before


@pytest.mark.parametrize(
    "stage,src,dst,why",
    [
        (Stage.GENERATE, S.DONE, S.RUNNING, "DONE is terminal"),
        (Stage.TRAIN, S.ERROR, S.IDLE, "ERROR is terminal"),
        (Stage.DATALOADER, S.RUNNING, S.RUNNING, "already RUNNING"),
        (Stage.TRAIN, S.RUNNING, S.PAUSED, "RUNNING may move only to ERROR, IDLE, WAITING_OUT"),
        (Stage.REWARD, S.IDLE, S.WAITING_OUTPUT_SPACE, "IDLE may move only to DONE, ERROR,"),
        (Stage.LOGP, S.WAITING_OUTPUT_SPACE, S.RUNNING, "may move only to ERROR, IDLE"),
        (Stage.REF_LOGP, S.RUNNING, S.DONE, "RUNNING may move only to"),
        (Stage.GENERATE, S.PAUSED, S.IDLE, "PAUSED may move only to ERROR, RUNNING"),
        (Stage.GENERATE, S.WAITING_INPUT, S.PAUSED, "WAITING_INPUT may move only to"),
        (Stage.PARAM_UPDATE, S.IDLE, S.RUNNING, "IDLE may move only to DONE, ERROR, WAITING_INP"),
        (Stage.PARAM_UPDATE, S.RUNNING, S.WAITING_OUTPUT_SPACE, "RUNNING may move only to ER"),
        (Stage.PARAM_UPDATE, S.WAITING_OUTPUT_SPACE, S.IDLE, "may move only to ERROR, RUNNING"),
        (Stage.VALIDATION, S.RUNNING, S.WAITING_OUTPUT_SPACE, "RUNNING may move only to ERROR"),
    ],
    ids=lambda v: v.value if isinstance(v, Stage) else v.name if isinstance(v, S) else None,
)
def test_illegal_transition_says_why(stage, src, dst, why):
    machine = machine_in(stage, src)
    with pytest.raises(IllegalTransition, match=rf"\(.*{why}.*\); requested for: next item"):
        machine.transition(dst, "next item")


def test_why_illegal_for_a_state_the_stage_never_enters():
    assert why_illegal(TRANSITIONS[Stage.TRAIN], S.PAUSED, S.RUNNING) == (
        "this stage never enters PAUSED"
    )


@pytest.mark.parametrize(
    "stage,src",
    [(stage, src) for stage in Stage for src in reachable(stage) if src not in TERMINAL],
    ids=lambda v: v.value if isinstance(v, Stage) else v.name,
)
def test_fail_from_every_non_terminal_state(stage, src):
    machine = machine_in(stage, src)
    error = OSError("engine 3 died")
    machine.fail(error)
    assert machine.state == S.ERROR and machine.is_terminal and machine.error is error
    assert machine.history()[-1].reason == "OSError: engine 3 died"


@pytest.mark.parametrize("terminal", [S.DONE, S.ERROR])
def test_fail_from_a_terminal_state_is_illegal(terminal):
    machine = machine_in(Stage.GENERATE, terminal)
    first = machine.error
    with pytest.raises(IllegalTransition, match=rf"{terminal.name} -> ERROR \({terminal.name} is"):
        machine.fail(ValueError("late"))
    assert machine.error is first


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.pop(S.PAUSED), r"lacks states \['PAUSED'\]"),
        (lambda t: t.update({S.IDLE: frozenset({S.IDLE, S.ERROR})}), "IDLE -> IDLE"),
        (lambda t: t.update({S.DONE: frozenset({S.IDLE})}), "DONE is terminal but has moves"),
        (lambda t: t.update({S.RUNNING: frozenset({S.IDLE})}), "RUNNING cannot move to ERROR"),
    ],
)
def test_malformed_table_is_refused(edit, match):
    table = dict(TRANSITIONS[Stage.TRAIN])
    edit(table)
    with pytest.raises(ValueError, match=match):
        check_table(table)
    with pytest.raises(ValueError, match=match):
        StageMachine(Stage.TRAIN, table)


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="'rollout' is not a valid Stage"):
        StageMachine("rollout")


def test_errors_survive_pickling():
    err = IllegalTransition("generate", S.DONE, S.RUNNING, "DONE is terminal", "step 4")
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.to_state == S.RUNNING
    timeout = StageTimeout("an item in queue q (empty)", 1.0, 1.0, {"role": "train"}, "q")
    copy = pickle.loads(pickle.dumps(timeout))
    assert str(copy) == str(timeout) and copy.context == {"role": "train"} and copy.queue == "q"
