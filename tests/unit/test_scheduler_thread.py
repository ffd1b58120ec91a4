"""The scheduler thread (`scheduler/scheduler.py`): it moves the machines, the main thread works.

Contracts checked: every item flows through every stage in order and every machine ends DONE;
work runs on the thread that called `run()`; the stage furthest downstream goes first when
several can start; a full output queue holds the result in WAITING_OUTPUT_SPACE
(back-pressure); a guard keeps a stage in WAITING_INPUT with its reason until it clears; a wait
longer than the timeout raises `StageTimeout` naming role, rank, stage, state and what it
waited for; an error in the work reaches the caller and leaves the machines in ERROR. Nothing is
faked but the work itself (small Python functions).
"""

import threading
import time

import pytest

from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.queues import BoundedQueue
from megatron_async_rl.scheduler.scheduler import Scheduler, StageTask
from megatron_async_rl.scheduler.states import Stage, StageState, StageTimeout


def _pipeline(num_items=4, capacity=2, guard=None, consume_delay_s=0.0):
    calls = []
    first, second = BoundedQueue("first", capacity), BoundedQueue("second", capacity)

    def load(index):
        calls.append(("dataloader", index, threading.current_thread().name))
        return index

    def double(item):
        calls.append(("generate", item, threading.current_thread().name))
        return item * 2

    def consume(item):
        time.sleep(consume_delay_s)
        calls.append(("reward", item, threading.current_thread().name))

    tasks = [
        StageTask(StageMachine(Stage.DATALOADER), load, output=first, num_items=num_items),
        StageTask(StageMachine(Stage.GENERATE), double, inputs=first, output=second, guard=guard),
        StageTask(StageMachine(Stage.REWARD), consume, inputs=second),
    ]
    return tasks, calls


def test_items_flow_in_order_on_the_main_thread_and_every_machine_ends_done():
    tasks, calls = _pipeline()
    Scheduler(tasks, role="generate", rank=3, timeout_s=5.0).run()
    assert [c[1] for c in calls if c[0] == "reward"] == [0, 2, 4, 6]
    assert {c[2] for c in calls} == {threading.current_thread().name}
    assert all(t.machine.state == StageState.DONE for t in tasks)


def test_the_stage_furthest_downstream_goes_first():
    tasks, calls = _pipeline(num_items=3)
    Scheduler(tasks, role="generate", rank=0, timeout_s=5.0).run()
    order = [(c[0], c[1]) for c in calls]
    # each item is carried to the end before the next one is loaded
    assert order[:3] == [("dataloader", 0), ("generate", 0), ("reward", 0)]


def test_a_full_output_queue_holds_the_result_waiting_for_space():
    first = BoundedQueue("first", 1)
    first.put("already there", 1.0)  # nobody consumes it until the end
    machine = StageMachine(Stage.DATALOADER)
    tasks = [StageTask(machine, lambda i: i, output=first, num_items=1)]
    scheduler = Scheduler(tasks, role="generate", rank=0, timeout_s=0.3)
    with pytest.raises(StageTimeout, match="waiting for space in queue first"):
        scheduler.run()
    moves = [(m.from_state, m.to_state) for m in machine.history()]
    assert (StageState.RUNNING, StageState.WAITING_OUTPUT_SPACE) in moves


def test_a_guard_holds_the_stage_with_its_reason_until_it_clears():
    allowed = threading.Event()

    def guard(item):
        return None if allowed.is_set() else f"engine weights for item {item}"

    tasks, calls = _pipeline(num_items=2, guard=guard)
    scheduler = Scheduler(tasks, role="generate", rank=0, timeout_s=5.0)
    seen = []

    def release():
        seen.append((tasks[1].machine.state, tasks[1].waiting_for))
        allowed.set()
        scheduler.wake()

    timer = threading.Timer(0.3, release)
    timer.start()
    scheduler.run()
    assert seen == [(StageState.WAITING_INPUT, "engine weights for item 0")]
    generate = tasks[1].machine
    assert [c[1] for c in calls if c[0] == "reward"] == [0, 2]
    assert generate.metrics()["scheduler/generate/idle_s"] >= 0.2


def test_a_wait_past_the_timeout_names_role_rank_stage_state_and_what_it_waited_for():
    tasks, _ = _pipeline(num_items=1, guard=lambda item: "engine weights v7 (engine serves v5)")
    scheduler = Scheduler(tasks, role="generate", rank=5, timeout_s=0.2)
    with pytest.raises(StageTimeout) as info:
        scheduler.run()
    text = str(info.value)
    for part in ("role generate", "rank 5", "stage generate", "state WAITING_INPUT",
                 "engine weights v7 (engine serves v5)"):  # fmt: skip
        assert part in text, text
    assert tasks[1].machine.state == StageState.ERROR


def test_an_error_in_the_work_reaches_the_caller_and_fails_the_machines():
    def broken(item):
        raise ValueError(f"bad item {item}")

    first = BoundedQueue("first", 2)
    tasks = [
        StageTask(StageMachine(Stage.DATALOADER), lambda i: i, output=first, num_items=3),
        StageTask(StageMachine(Stage.GENERATE), broken, inputs=first),
    ]
    with pytest.raises(ValueError, match="bad item 0"):
        Scheduler(tasks, role="generate", rank=0, timeout_s=5.0).run()
    time.sleep(0.1)  # the scheduler thread records the failure after handing it back
    assert tasks[1].machine.state == StageState.ERROR
    assert isinstance(tasks[1].machine.error, ValueError)


def test_a_task_without_inputs_runs_whenever_its_guard_clears_and_stops_with_done_when():
    flags = {"due": [1, 3], "runs": []}
    source = BoundedQueue("first", 4)
    loader = StageMachine(Stage.DATALOADER)

    def guard(_):
        return None if flags["due"] else "a due version"

    def validate(_):
        flags["runs"].append(flags["due"].pop(0))

    tasks = [
        StageTask(loader, lambda i: i, output=source, num_items=4),
        StageTask(
            StageMachine(Stage.VALIDATION),
            validate,
            guard=guard,
            done_when=lambda: loader.is_terminal,
        ),  # fmt: skip
    ]
    Scheduler(tasks, role="generate", rank=0, timeout_s=5.0).run()
    assert flags["runs"] == [1, 3]
    assert tasks[1].machine.state == StageState.DONE


def test_queue_peek_does_not_take_the_item():
    queue = BoundedQueue("q", 2)
    assert queue.peek() == (False, None)
    queue.put("a", 1.0)
    assert queue.peek() == (True, "a")
    assert queue.qsize() == 1
