"""The one clock of a rank: its stage machines' spans, and the three views users read of them.

Owned here: `RankClock`. Every stage machine of a rank is made by `RankClock.machine`, on wall
time (so the spans of all ranks share one axis), and reports each finished span here. From those
spans alone come:

- the trace (`trace.json`, `timeline.png`): one complete event per RUNNING span, named by the
  stage's metric name, and one per PAUSED span (`generate (paused)`: an in-flight weight load);
- `timing/<name>_s` of a step: the sum of the stage's RUNNING spans labelled with that step
  (`timings(step)`);
- `utilization/<group>/*`: the union of the rank's RUNNING spans in the window since the last
  call (`utilization()`), of the learn stages only those of roles the rank holds
  (`LEARN_STAGE_ROLES`); a wait (WAITING_INPUT, WAITING_OUTPUT_SPACE, PAUSED) is never busy.

So the three agree by construction (on a rank holding every role it runs);
`scheduler/<stage>/busy_s` (the machines' own totals) is the running sum of the same spans.
Called by the jobs (one clock per rank, passed to the sides).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from megatron_async_rl.observability.trace import TraceRecorder
from megatron_async_rl.observability.utilization import busy_idle
from megatron_async_rl.scheduler.machine import Span, StageMachine
from megatron_async_rl.scheduler.states import Stage, StageState

METRIC_NAMES = {
    Stage.REF_LOGP: "ref",
    Stage.PARAM_UPDATE: "weight_sync",
}
"""Stages whose metric and trace name is not the stage's own (names users already know)."""
GENERATE_SIDE_NAMES = {Stage.PARAM_UPDATE: "load_weights"}
"""On a generate-only rank the param_update machine loads weights into the engine."""
LEARN_STAGE_ROLES = {"logp": "logp", "ref": "ref", "reward_model": "reward_model",
                     "critic_values": "critic", "train": "train", "critic_train": "critic"}
"""The role whose work a learn stage is. Every Megatron rank runs every learn stage, and on a
rank without the role the stage is the batch's layout, the train stage's gather (a wait for the
other roles) and GAE, or nothing: not counted busy in `utilization()` (timings and the trace
keep every span)."""
PAUSED_SUFFIX = " (paused)"
MAX_OPEN_STEPS = 64
"""Steps whose timings are kept until taken; older ones are dropped (a view nobody read)."""


class RankClock:
    """The machines of one rank and the views of their spans (thread-safe)."""

    def __init__(self, rank: int, roles: tuple[str, ...], clock=time.time):
        self.rank, self.roles = rank, tuple(roles)
        self.trace = TraceRecorder(rank, self.roles, clock=clock)
        self._clock = clock
        self._names = dict(METRIC_NAMES)
        if self.roles == ("generate",):
            self._names.update(GENERATE_SIDE_NAMES)
        self._lock = threading.Lock()
        self._busy: dict[int | None, dict[str, float]] = defaultdict(dict)
        self._since = clock()

    def name(self, stage: Stage) -> str:
        """The stage's name in metrics and the trace."""
        return self._names.get(stage, stage.value)

    def machine(self, stage: Stage | str) -> StageMachine:
        """A machine for `stage` whose spans this clock records."""
        return StageMachine(stage, clock=self._clock, observer=self._observe)

    def _observe(self, stage: Stage, span: Span) -> None:
        name = self.name(stage)
        if span.state == StageState.PAUSED:
            self.trace.add(name + PAUSED_SUFFIX, span.start, span.end, step=span.step)
        if span.state != StageState.RUNNING:
            return
        self.trace.add(name, span.start, span.end, step=span.step)
        with self._lock:
            per_step = self._busy[span.step]
            per_step[name] = per_step.get(name, 0.0) + (span.end - span.start)
            while len(self._busy) > MAX_OPEN_STEPS:
                del self._busy[next(iter(self._busy))]

    def timings(self, step: int | None, stages: tuple[Stage, ...] | None = None) -> dict:
        """`timing/<name>_s` of the spans labelled `step` (of `stages` only, when given), taken:
        a second call does not count them again. None takes the unlabelled spans."""
        names = None if stages is None else {self.name(s) for s in stages}
        with self._lock:
            per_step = self._busy.get(step, {})
            taken = {n: v for n, v in per_step.items() if names is None or n in names}
            for n in taken:
                del per_step[n]
            if not per_step:
                self._busy.pop(step, None)
        return {f"timing/{n}_s": v for n, v in taken.items()}

    def utilization(self) -> dict[str, float]:
        """This rank's busy and idle seconds and bubble ratio since the previous call
        (`utilization/<group>/...`; the leader averages them over each group's ranks)."""
        now, since = self._clock(), self._since
        self._since = now
        if now <= since:
            return {}
        spans = [
            s for s in self.trace.spans(since_s=since)
            if not s["stage"].endswith(PAUSED_SUFFIX)
            and LEARN_STAGE_ROLES.get(s["stage"], self.roles[0]) in self.roles
        ]  # fmt: skip
        return busy_idle(spans, since, now, {self.rank: self.roles})
