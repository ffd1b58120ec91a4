"""The scheduler thread of one rank: it steps the stage machines, the main thread does the work.

    generate ranks                                     Megatron ranks (train, logp, ref)
    dataloader --[prompts]--> generate --[rollouts]--> reward --[scored]==samples==> [samples]
       ^ cursor                 ^ admission: engine                                    |
                                | holds v >= s - N        logp --[logp]--> ref_logp --[ref]
    validation (due version     |                          ^ logp weights = v_s          |
      loaded, not evaluated)  param_update <====weights==== param_update <--[trained]-- train
                              (weight thread)              (sync + metrics)

    stage         waits for (WAITING_INPUT)                   output (WAITING_OUTPUT_SPACE)
    dataloader    nothing (a source of num_steps batches)     prompts queue has space
    generate      a prompt batch; engine weights >= s - N      rollouts queue has space
    reward        rollouts                                     scored queue has space
    validation    a due version loaded and not yet evaluated   (metrics: never waits)
    logp          samples of step s; logp weights = v_s        logp queue has space
    ref_logp      logp results                                 ref queue has space
    train         ref results                                  trained queue has space
    param_update  trained step (Megatron) / a new version      engines idle (generate side)

    `==` crosses ranks over a gloo group owned by one thread per rank (samples: the sender and
    receiver threads; weights: the weight thread), so a blocking collective never stalls the
    scheduler. Every wait is bounded by `stage_timeout_s`.

Owned here: `StageTask` (a machine, its work, its queues and start condition), `Scheduler`, and
`HelperThread` (a thread beside it whose failure its guards re-raise).
Called by `jobs/grpo_async.py` on every rank. The scheduler thread only moves machines and picks
work; the main thread runs the work (engine calls, Megatron forward/backward), one item at a
time, so roles sharing a rank window are serialised on it. When several tasks can start, the one
furthest downstream (last added) goes first: finishing a step beats starting the next, which
keeps every rank's collectives in step order. A task that waits longer than the timeout stops
the run with `StageTimeout` naming role, rank, stage, state and what it waited for.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_async_rl.distributed.collective_errors import name_failure
from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.queues import BoundedQueue, QueueClosed
from megatron_async_rl.scheduler.states import StageState, StageTimeout
from megatron_async_rl.scheduler.watchdog import StallWatchdog

S = StageState
POLL_S = 0.002
"""How often the scheduler thread re-checks waiting tasks (queues and guards change in other
threads). Small against a step: a poll costs microseconds."""


@dataclass
class StageTask:
    """One stage on this rank.

    `work(item)` runs on the main thread and returns the item for `output` (None: the result
    is dropped). A source task (`inputs` None) produces `num_items` items; `work(index)`.
    `guard(item)` says what the task still waits for before it may start on `item` (None:
    nothing): e.g. engine weights new enough for the item's step. `finish(result)`, when given,
    runs on the main thread after the machine left RUNNING: what must see the stage's span
    closed (writing the step's metrics) goes there. An item's step (its `step` attribute, or
    the index of a source's item) labels the machine's spans.
    """

    machine: StageMachine
    work: Callable[[Any], Any]
    inputs: BoundedQueue | None = None
    output: BoundedQueue | None = None
    guard: Callable[[Any], str | None] | None = None
    num_items: int | None = None
    done_when: Callable[[], bool] | None = None
    """For a task without inputs and without `num_items`: when it is finished."""
    finish: Callable[[Any], None] | None = None
    produced: int = field(default=0, init=False)
    held: Any = field(default=None, init=False)
    """A result waiting for space in `output`."""
    waiting_since: float | None = field(default=None, init=False)
    waiting_for: str | None = field(default=None, init=False)
    """What the task waits for right now (None while it runs or is idle)."""

    @property
    def name(self) -> str:
        return self.machine.stage.value


class Scheduler:
    """Steps the machines of one rank's tasks; `run()` on the main thread does their work."""

    def __init__(self, tasks: list[StageTask], *, role: str, rank: int, timeout_s: float):
        self.tasks, self.role, self.rank, self.timeout_s = tasks, role, rank, timeout_s
        self._to_main: queue.Queue = queue.Queue(maxsize=1)
        self._from_main: queue.Queue = queue.Queue(maxsize=1)
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self.progress = 0
        """Work items finished and results handed on: the step watchdog watches it move."""
        self.main_thread: int | None = None
        """Ident of the thread in `run()`, where the work runs."""
        self.watchdog: StallWatchdog | None = None

    def wake(self) -> None:
        """Tell the scheduler that a queue or a guard changed in another thread."""
        self._wake.set()

    def run(self) -> None:
        """Run every task to DONE (blocking, main thread); re-raises the first error."""
        self.main_thread = threading.get_ident()
        thread = threading.Thread(target=self._loop, name=f"scheduler-{self.role}", daemon=True)
        thread.start()
        self.watchdog = StallWatchdog(self, self.timeout_s)
        self.watchdog.start()
        try:
            while True:
                try:
                    kind, task, item = self._to_main.get(timeout=1.0)
                except queue.Empty:
                    if not thread.is_alive():
                        raise RuntimeError(self._who("the scheduler thread ended")) from None
                    continue
                if kind == "stop":
                    break
                if kind == "error":
                    raise item
                try:
                    result = task.work(item) if kind == "work" else task.finish(item)
                except BaseException as err:
                    context = {"role": self.role, "rank": self.rank, "stage": task.name}
                    named = name_failure(err, context)  # a collective's failure, named
                    self._from_main.put((False, named))
                    if named is err:
                        raise
                    raise named from err
                self.progress += 1
                self._from_main.put((True, result))
        finally:
            for task in self.tasks:
                if task.output is not None:
                    task.output.close()
            self._wake.set()
            self.watchdog.stop()
            thread.join(timeout=5.0)

    # -- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not all(task.machine.is_terminal for task in self.tasks):
                ready = None
                for task in reversed(self.tasks):  # downstream first
                    if not task.machine.is_terminal and self._poll(task):
                        ready = task
                        break
                if ready is None:
                    self._check_timeouts()
                    self._wake.wait(POLL_S)
                    self._wake.clear()
                    continue
                self._start(ready)
            self._to_main.put(("stop", None, None))
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self.error = err
            for task in self.tasks:
                if not task.machine.is_terminal:
                    task.machine.fail(err)
            try:
                self._to_main.put_nowait(("error", None, err))
            except queue.Full:  # the main thread already stopped with its own error
                pass

    def _poll(self, task: StageTask) -> bool:
        """Move `task` by what it waits for; True when it can start now."""
        machine = task.machine
        if task.held is not None:  # a result waiting for space downstream
            if task.output.try_put(task.held):
                self.progress += 1
                task.held, task.waiting_since, task.waiting_for = None, None, None
                machine.transition(S.IDLE, f"result handed to {task.output.name}")
            else:
                self._check_wait(task, f"space in queue {task.output.name}")
            return False
        waiting_for = self._waiting_for(task)
        if waiting_for == "done":
            machine.transition(S.DONE, "no more input")
            if task.output is not None:
                task.output.close()
            return False
        if waiting_for is None:
            return True
        if machine.state == S.IDLE:
            machine.transition(S.WAITING_INPUT, waiting_for)
            task.waiting_since = time.monotonic()
        self._check_wait(task, waiting_for)
        return False

    def _waiting_for(self, task: StageTask) -> str | None:
        """'done', None (can start) or what the task waits for."""
        if task.inputs is None:
            if task.num_items is not None and task.produced >= task.num_items:
                return "done"
            if task.done_when is not None and task.done_when():
                return "done"
            return task.guard(None) if task.guard is not None else None
        try:
            has_item, item = task.inputs.peek()
        except QueueClosed:
            return "done"
        if not has_item:
            return f"an item in queue {task.inputs.name}"
        return task.guard(item) if task.guard is not None else None

    def _start(self, task: StageTask) -> None:
        machine = task.machine
        if task.inputs is None:
            item = task.produced
        else:
            _, item = task.inputs.try_get()
        task.produced += 1
        task.waiting_since, task.waiting_for = None, None
        step = item if task.inputs is None else getattr(item, "step", None)
        machine.transition(S.RUNNING, f"item {task.produced - 1}", step=step)
        result = self._on_main("work", task, item)
        # The span closes before the result is handed on (only this thread puts into a task's
        # output, so space seen here is still there): a consumer sees the stage's time whole.
        if result is None or task.output is None or task.output.has_space():
            machine.transition(S.IDLE, "done")
            if result is not None and task.output is not None:
                task.output.try_put(result)
        else:
            task.held = result
            machine.transition(S.WAITING_OUTPUT_SPACE, f"queue {task.output.name} is full")
            task.waiting_since = time.monotonic()
        if task.finish is not None:
            self._on_main("finish", task, result)

    def _on_main(self, kind: str, task: StageTask, item: Any) -> Any:
        """Run `task.work(item)` or `task.finish(item)` on the main thread; its result."""
        self._to_main.put((kind, task, item))
        ok, result = self._from_main.get()
        if not ok:
            raise result
        return result

    def _check_wait(self, task: StageTask, waiting_for: str) -> None:
        task.waiting_for = waiting_for
        if task.waiting_since is None:
            task.waiting_since = time.monotonic()

    def _check_timeouts(self) -> None:
        """When a task waited too long, raise for the cause: the most upstream task that waits
        on a condition of its own (a guard: weights, validation) rather than on a queue, since
        tasks waiting for its output (or, upstream, for space it would free) are symptoms; else
        for the task itself, naming a stage upstream still working (a stuck call) if any."""
        now = time.monotonic()
        for task in self.tasks:
            if task.waiting_since is None or task.machine.is_terminal:
                continue
            if now - task.waiting_since <= self.timeout_s:
                continue
            cause = next((t for t in self.tasks if self._waits_on_guard(t)), task)
            context = {"role": self.role, "rank": self.rank, **cause.machine.context()}
            if cause is not task:
                context["symptom"] = f"stage {task.name} waited for {task.waiting_for}"
            running = self._running_upstream(cause)
            if running is not None:
                context["cause"] = running
            queue_name = cause.inputs.name if cause.inputs is not None else None
            waited = now - cause.waiting_since
            raise StageTimeout(cause.waiting_for, waited, self.timeout_s, context, queue_name)

    @staticmethod
    def _waits_on_guard(task: StageTask) -> bool:
        return (
            task.waiting_since is not None
            and not task.machine.is_terminal
            and task.machine.state == S.WAITING_INPUT
            and task.waiting_for is not None
            and not task.waiting_for.startswith("an item in queue")
        )

    def _running_upstream(self, task: StageTask) -> str | None:
        """The stage upstream of `task` still working on an item (a stuck call), if any."""
        for other in reversed(self.tasks[: self.tasks.index(task)]):
            if other.machine.state in (S.RUNNING, S.PAUSED):
                since = other.machine.spans(include_current=True)[-1]
                return (
                    f"stage {other.name} upstream has been {other.machine.state.name} for "
                    f"{since.end - since.start:.3g} s"
                )
        return None

    def _who(self, what: str) -> str:
        return f"role {self.role}, rank {self.rank}: {what}"

    def metrics(self) -> dict[str, float]:
        """Busy/idle seconds of every machine and the sizes and waits of every queue."""
        out: dict[str, float] = {}
        for task in self.tasks:
            out.update(task.machine.metrics())
            if task.output is not None:
                out.update(task.output.metrics(prefix="scheduler/queue"))
        if self.watchdog is not None:
            out["scheduler/stalls"] = float(self.watchdog.stalls)
        return out


class HelperThread(threading.Thread):
    """A thread beside a scheduler (the samples sender or receiver of the asynchronous loop)
    whose error the scheduler's guards re-raise: a failure wakes the scheduler, and the next
    guard's `check` raises it naming the thread."""

    def __init__(self, name: str, target: Callable[[], None], wake: Callable[[], None]):
        super().__init__(name=name, daemon=True)
        self.target, self.wake = target, wake
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.target()
        except BaseException as err:  # noqa: BLE001 - surfaced by the scheduler's checks
            self.error = name_failure(err, {"stage": self.name})
            self.wake()

    def check(self, who: str) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"{who}: the {self.name} thread failed: {self.error}"
            ) from self.error

    def finish(self, timeout: float, waiting_for: str, context: dict) -> None:
        self.join(timeout=timeout)
        if self.is_alive():
            raise StageTimeout(waiting_for, timeout, timeout, context)
