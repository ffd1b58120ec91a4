"""Bounded queues between stages (`scheduler.queues`).

Contract checked: items come out in the order they went in; a producer blocks while the queue is
full and resumes when a consumer takes an item (back-pressure); a wait that runs past its timeout
raises StageTimeout naming role, rank, stage, state and what it waited for (space, with capacity
and size, or an item); `close` lets consumers drain what is queued, then raises QueueClosed, and
wakes threads blocked in put or get. Nothing is faked: real threads, real short timeouts.
"""

import re
import threading
import time

import pytest

from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.queues import BoundedQueue, QueueClosed
from megatron_async_rl.scheduler.states import StageState, StageTimeout

SHORT = 0.05
LONG = 5.0  # a bound no passing test comes near: a failure, not a slow pass, if reached


def wait_until(predicate, timeout_s=LONG):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_fifo_and_non_blocking_ops():
    queue = BoundedQueue("rollouts", 2)
    assert queue.try_get() == (False, None)
    assert queue.try_put("a") and queue.try_put("b")
    assert not queue.try_put("c") and queue.qsize() == 2
    assert queue.try_get() == (True, "a")
    queue.put("c", SHORT)
    assert [queue.get(SHORT), queue.get(SHORT)] == ["b", "c"]
    assert queue.metrics()["queue/rollouts/max_size"] == 2.0


def test_producer_blocks_when_full_until_the_consumer_takes():
    queue = BoundedQueue("rollouts", 2)
    done = []

    def producer():
        for item in range(5):
            queue.put(item, LONG)
            done.append(item)

    thread = threading.Thread(target=producer)
    thread.start()
    wait_until(lambda: queue.qsize() == 2)
    time.sleep(SHORT)  # the producer had time to put a third item, had it not been blocked
    assert done == [0, 1] and thread.is_alive()
    assert queue.get(LONG) == 0
    wait_until(lambda: done == [0, 1, 2])
    got = [queue.get(LONG) for _ in range(4)]
    thread.join(LONG)
    assert got == [1, 2, 3, 4] and not thread.is_alive()
    assert queue.metrics()["queue/rollouts/put_wait_s"] >= SHORT
    assert queue.metrics()["queue/rollouts/max_size"] == 2.0


def test_consumer_blocks_until_an_item_arrives():
    queue = BoundedQueue("scored", 1)
    got = []
    thread = threading.Thread(target=lambda: got.append(queue.get(LONG)))
    thread.start()
    time.sleep(SHORT)
    assert got == [] and thread.is_alive()
    queue.put("batch 0", SHORT)
    thread.join(LONG)
    assert got == ["batch 0"]


def test_put_timeout_names_who_waited_for_what():
    queue = BoundedQueue("rollouts", 2)
    queue.put(0, SHORT)
    queue.put(1, SHORT)
    machine = StageMachine("generate")
    machine.transition(StageState.RUNNING, "step 3")
    machine.transition(StageState.WAITING_OUTPUT_SPACE, "rollouts full")
    context = {"role": "generate", "rank": 1, **machine.context(), "step": 3}
    with pytest.raises(StageTimeout) as info:
        queue.put(2, SHORT, context)
    message = str(info.value)
    assert re.match(
        r"role generate, rank 1, stage generate, state WAITING_OUTPUT_SPACE, step 3: timed out "
        r"after [0-9.]+ s ",
        message,
    )
    assert "(timeout 0.05 s) waiting for space in queue rollouts (capacity 2, size 2)" in message
    assert "scheduler.stage_timeout_s" in message
    err = info.value
    assert err.queue == "rollouts" and err.timeout_s == SHORT and err.waited_s >= SHORT * 0.9
    assert err.context["state"] == "WAITING_OUTPUT_SPACE"
    assert queue.qsize() == 2


def test_get_timeout_names_who_waited_for_what():
    queue = BoundedQueue("logp_out", 2)
    context = {"role": "train", "rank": 0, "stage": "train", "state": "WAITING_INPUT"}
    pattern = (
        r"^role train, rank 0, stage train, state WAITING_INPUT: timed out after [0-9.]+ s "
        r"\(timeout 0.05 s\) waiting for an item in queue logp_out \(empty\)"
    )
    with pytest.raises(StageTimeout, match=pattern):
        queue.get(SHORT, context)


def test_timeout_without_context_marks_the_unknowns():
    with pytest.raises(StageTimeout, match=r"^role \?, rank \?, stage \?, state \?: timed out"):
        BoundedQueue("q", 1).get(0.001)


def test_close_lets_consumers_drain_then_raises():
    queue = BoundedQueue("rollouts", 3)
    queue.put("a", SHORT)
    queue.put("b", SHORT)
    queue.close()
    queue.close()  # idempotent
    assert queue.closed
    with pytest.raises(QueueClosed, match="queue rollouts is closed: cannot put"):
        queue.put("c", SHORT)
    with pytest.raises(QueueClosed, match="queue rollouts is closed: cannot put"):
        queue.try_put("c")
    assert queue.get(SHORT) == "a" and queue.try_get() == (True, "b")
    with pytest.raises(QueueClosed, match="queue rollouts is closed and drained"):
        queue.get(SHORT)
    with pytest.raises(QueueClosed, match="queue rollouts is closed and drained"):
        queue.try_get()


@pytest.mark.parametrize("side", ["get", "put"])
def test_close_wakes_a_blocked_thread(side):
    queue = BoundedQueue("rollouts", 1)
    if side == "put":
        queue.put("full", SHORT)
    outcome = []

    def blocked():
        start = time.monotonic()
        try:
            queue.get(LONG) if side == "get" else queue.put("more", LONG)
        except QueueClosed:
            outcome.append(time.monotonic() - start)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(SHORT)
    queue.close()
    thread.join(LONG)
    assert len(outcome) == 1 and outcome[0] < LONG / 2


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, None])
def test_capacity_must_be_a_positive_integer(capacity):
    with pytest.raises(ValueError, match=rf"queue q: capacity = {capacity!r}: must be an integer"):
        BoundedQueue("q", capacity)


def test_waits_are_measured_on_the_given_clock():
    ticks = iter([10.0, 12.5, 20.0, 20.25])
    queue = BoundedQueue("q", 1, clock=lambda: next(ticks))
    queue.put("x", SHORT)
    queue.get(SHORT)
    metrics = queue.metrics()
    assert metrics["queue/q/put_wait_s"] == 2.5 and metrics["queue/q/get_wait_s"] == 0.25
