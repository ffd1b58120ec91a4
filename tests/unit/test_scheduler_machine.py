"""Time accounting of a stage machine (`scheduler.machine.StageMachine`).

Contract checked: busy seconds are the time in RUNNING, idle seconds the time in WAITING_INPUT,
WAITING_OUTPUT_SPACE and PAUSED (IDLE counts as neither), both including the current stretch;
spans tile time without gaps, also while another thread reads metrics; history is bounded while
the totals keep counting; `context` names stage and state. Faked: the clock only.
"""

import threading

import pytest

from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.states import Stage, StageState
from tests.harness.clocks import FakeClock

S = StageState


def test_busy_and_idle_seconds():
    clock = FakeClock()
    machine = StageMachine(Stage.GENERATE, clock=clock)
    for state, seconds in [
        (S.WAITING_INPUT, 1.0),  # idle
        (S.RUNNING, 2.0),  # busy
        (S.PAUSED, 0.5),  # idle
        (S.RUNNING, 3.0),  # busy
        (S.WAITING_OUTPUT_SPACE, 4.0),  # idle
        (S.IDLE, 10.0),  # neither
        (S.RUNNING, 0.25),  # busy, still running when read
    ]:
        machine.transition(state, "test")
        clock.advance(seconds)
    assert machine.busy_s == pytest.approx(5.25)
    assert machine.idle_s == pytest.approx(5.5)
    assert machine.seconds_in(S.IDLE) == pytest.approx(10.0)
    metrics = machine.metrics()
    assert metrics["scheduler/generate/busy_s"] == pytest.approx(5.25)
    assert metrics["scheduler/generate/idle_s"] == pytest.approx(5.5)
    assert metrics["scheduler/generate/in_paused_s"] == pytest.approx(0.5)
    assert metrics["scheduler/generate/in_idle_s"] == pytest.approx(10.0)
    spans = machine.spans(include_current=True)
    assert [s.state for s in spans] == [S.IDLE, S.WAITING_INPUT, S.RUNNING, S.PAUSED, S.RUNNING,
                                        S.WAITING_OUTPUT_SPACE, S.IDLE, S.RUNNING]  # fmt: skip
    assert spans[-1].end == clock.now and len(machine.spans()) == len(spans) - 1
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))


def test_history_is_bounded_but_totals_are_not():
    clock = FakeClock()
    machine = StageMachine("train", clock=clock, max_history=3)
    for _ in range(5):
        for state in (S.RUNNING, S.IDLE):
            machine.transition(state, "test")
            clock.advance(1.0)
    assert len(machine.history()) == 3 and len(machine.spans()) == 3
    assert machine.busy_s == 5.0


def test_spans_tile_time_while_another_thread_reads():
    machine = StageMachine(Stage.REWARD)
    stop = threading.Event()
    reads = []

    def reader():
        while not stop.is_set():
            reads.append((machine.busy_s, machine.idle_s, machine.state))

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(300):
        for state in (S.WAITING_INPUT, S.RUNNING, S.WAITING_OUTPUT_SPACE, S.IDLE):
            machine.transition(state, "test")
    stop.set()
    thread.join()
    spans = machine.spans()
    assert len(spans) == 1200 and all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert reads and all(b >= 0 and i >= 0 for b, i, _ in reads)


def test_context_names_stage_and_state():
    machine = StageMachine(Stage.LOGP)
    machine.transition(S.WAITING_INPUT, "test")
    assert machine.context() == {"stage": "logp", "state": "WAITING_INPUT"}
