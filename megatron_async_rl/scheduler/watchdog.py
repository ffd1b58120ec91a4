"""The step watchdog: reports a rank whose scheduler makes no progress.

Owned here: `StallWatchdog`, a thread `Scheduler.run` starts. Every wait of a stage is bounded
already (`StageTimeout`), and so is every collective (the groups' timeout); what neither sees is
a stage whose work call makes no progress within its bound, e.g. a collective whose peer hangs
(SIGSTOP) until the group's timeout, or an engine call within its own, longer timeout. When no
work item finished and no result moved on (`Scheduler.progress`) for `timeout_s`, the watchdog
logs, once per `timeout_s` of stall: role, rank, the step, every stage's state and what it waits
for, and where the main thread stands (the collective it is in, from its live stack). It reports;
it never kills (the bounded waits end the run). Counted as `scheduler/stalls`. Pure of torch.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from megatron_async_rl.distributed.collective_errors import stalled_in

logger = logging.getLogger(__name__)


class StallWatchdog(threading.Thread):
    """Watches `scheduler.progress`; `report(text)` when it stands still for `timeout_s`."""

    def __init__(
        self,
        scheduler,
        timeout_s: float,
        report: Callable[[str], None] | None = None,
        check_every_s: float | None = None,
    ):
        super().__init__(name=f"watchdog-{scheduler.role}", daemon=True)
        self.scheduler, self.timeout_s = scheduler, timeout_s
        self.report = report or logger.warning
        self.check_every_s = check_every_s or min(max(timeout_s / 10, 0.05), 30.0)
        self.stalls = 0
        self._halt = threading.Event()  # not `_stop`: Thread has a method of that name

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        seen, since, reported = self.scheduler.progress, time.monotonic(), 0
        while not self._halt.wait(self.check_every_s):
            if self.scheduler.progress != seen:
                seen, since, reported = self.scheduler.progress, time.monotonic(), 0
                continue
            stalled = time.monotonic() - since
            if stalled >= self.timeout_s * (reported + 1):
                reported += 1
                self.stalls += 1
                self.report(self.describe(stalled))

    def describe(self, stalled_s: float) -> str:
        """What the rank is doing: its stages and where the main thread stands."""
        sched = self.scheduler
        stages = []
        for task in sched.tasks:
            machine = task.machine
            if machine.is_terminal:
                continue
            current = machine.spans(include_current=True)[-1]
            line = f"{task.name} {machine.state.name} for {current.end - current.start:.0f} s"
            if current.step is not None:
                line += f" (step {current.step})"
            if task.waiting_for:
                line += f" waiting for {task.waiting_for}"
            stages.append(line)
        frame = sys._current_frames().get(sched.main_thread) if sched.main_thread else None
        return (
            f"step watchdog: role {sched.role}, rank {sched.rank}: no stage made progress for "
            f"{stalled_s:.0f} s (scheduler.stage_timeout_s {self.timeout_s:g}); "
            f"stages: {'; '.join(stages) or 'none'}; main thread in {stalled_in(frame)}"
        )
