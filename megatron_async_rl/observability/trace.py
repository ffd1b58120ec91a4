"""Stage spans of every rank as a Chrome trace (the JSON that Perfetto and chrome://tracing open).

Owned here: `TraceRecorder` (one per rank; the scheduler wraps each stage in `span(stage)`),
`merge_traces` (rank 0, on the per-rank event lists the caller gathered), `write_trace` and
`validate_trace` (also used by tests and the acceptance check on `trace.json`).

In the merged trace each rank is a process row named `rank 3 (train+logp)` and each stage a
thread row (lane) inside it. Complete events (`"ph": "X"`) carry `ts` and `dur` in microseconds;
`ts` is `time.time()` in microseconds since the Unix epoch, so events of different ranks line up.
Clock skew between nodes is not corrected: spans of ranks on different hosts are offset by the
hosts' NTP error (typically under a millisecond).

A recorder keeps at most `max_events` events and drops the oldest past that; the number dropped
travels in a `dropped_events` metadata event and is summed in the merged trace's `metadata`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

_US = 1e6
_COMMON = ("name", "ph", "pid")
# Fields each phase needs besides `_COMMON`; phases of the format not listed need only those.
_REQUIRED = {
    "X": ("ts", "dur", "tid"),
    "B": ("ts", "tid"),
    "E": ("ts", "tid"),
    "i": ("ts", "tid"),
    "I": ("ts", "tid"),
    "C": ("ts", "args"),
    "M": ("args",),
}
_PHASES = set(_REQUIRED) | set("bneSTpFsftPNODVvRc")
_DROPPED = "dropped_events"
SPAN_ORDER_SLACK_S = 5.0
"""Threads append their spans as they end, so end times are in append order up to the time
between a span's end and its append; `spans(since_s)` reads that much further back."""


class TraceRecorder:
    """Complete and instant events of one rank, bounded to the newest `max_events`.

    `cat` of a span is its role: `role=` when given, else the stage's name when it is one of the
    rank's roles, else the rank's only role, else `"stage"`. Lanes (`tid`) are numbered from 1 in
    the order of `stages`, then of first use; lane 0 holds instant events. Safe to record from
    the scheduler thread and the main thread at once.
    """

    def __init__(
        self,
        rank: int,
        roles: tuple[str, ...],
        clock: Callable[[], float] = time.time,
        max_events: int = 100_000,
        stages: Sequence[str] = (),
    ):
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"TraceRecorder max_events must be an int >= 1, got {max_events!r}")
        self.rank = rank
        self.roles = tuple(roles)
        self.max_events = max_events
        self.dropped = 0
        self._clock = clock
        self._events: deque[tuple] = deque(maxlen=max_events)
        self._lanes: dict[str, int] = {stage: i for i, stage in enumerate(stages, start=1)}
        self._lock = threading.Lock()

    @contextmanager
    def span(self, stage: str, role: str | None = None, **args) -> Iterator[None]:
        """Record the wall time of the block as one complete event, even when it raises."""
        start = self._clock()
        try:
            yield
        finally:
            # time.time() may step back under NTP; a span is never negative.
            self.add(stage, start, max(self._clock(), start), role=role, **args)

    def add(self, stage: str, start_s: float, end_s: float, role: str | None = None, **args):
        """Record a span measured elsewhere; times are seconds on this recorder's clock."""
        if not (math.isfinite(start_s) and math.isfinite(end_s)) or end_s < start_s:
            raise ValueError(
                f"span {stage!r} on rank {self.rank} needs finite start_s <= end_s, got "
                f"start_s={start_s!r}, end_s={end_s!r}"
            )
        category = role or (
            stage if stage in self.roles else self.roles[0] if len(self.roles) == 1 else "stage"
        )
        with self._lock:
            lane = self._lanes.setdefault(stage, len(self._lanes) + 1)
            self._append(("X", stage, category, start_s, end_s - start_s, lane, args))

    def instant(self, name: str, **args) -> None:
        """Record a point in time (a weight update landing, a checkpoint) on the `events` lane."""
        with self._lock:
            self._append(("i", name, "event", self._clock(), 0.0, 0, args))

    def _append(self, event: tuple) -> None:
        if len(self._events) == self.max_events:
            self.dropped += 1
        self._events.append(event)

    def events(self) -> list[dict]:
        """Metadata events (rank and lane names, dropped count), then the recorded events."""
        with self._lock:
            recorded, lanes, dropped = list(self._events), self._lanes.copy(), self.dropped
        label = f"rank {self.rank} ({'+'.join(self.roles)})" if self.roles else f"rank {self.rank}"
        out = [
            _meta("process_name", self.rank, {"name": label}),
            _meta("process_sort_index", self.rank, {"sort_index": self.rank}),
            _meta(_DROPPED, self.rank, {"dropped": dropped, "max_events": self.max_events}),
        ]
        named = list(lanes.items())
        if any(phase == "i" for phase, *_ in recorded):
            named.insert(0, ("events", 0))
        for stage, lane in named:
            out.append(_meta("thread_name", self.rank, {"name": stage}, lane))
            out.append(_meta("thread_sort_index", self.rank, {"sort_index": lane}, lane))
        for phase, name, category, start_s, dur_s, lane, args in recorded:
            event = {"name": name, "cat": category, "ph": phase, "ts": round(start_s * _US, 3)}
            if phase == "X":
                event["dur"] = round(dur_s * _US, 3)
            else:
                event["s"] = "t"
            event.update(pid=self.rank, tid=lane, args=dict(args))
            out.append(event)
        return out

    def spans(self, since_s: float | None = None) -> list[dict]:
        """The recorded spans as `dict(stage, rank, start_s, end_s)` (clock seconds), the input
        of `utilization.busy_idle` and `plots.plot_stage_timeline`. With `since_s`, only those
        ending after it, read from the newest back (a per-step caller stays O(spans per step))."""
        with self._lock:
            if since_s is None:
                recorded = list(self._events)
            else:
                recorded = []
                for event in reversed(self._events):
                    if event[3] + event[4] <= since_s - SPAN_ORDER_SLACK_S:
                        break  # events are appended as they end: the rest ended earlier
                    recorded.append(event)
                recorded.reverse()
        return [
            dict(stage=name, rank=self.rank, start_s=start_s, end_s=start_s + dur_s)
            for phase, name, _, start_s, dur_s, _, _ in recorded
            if phase == "X" and (since_s is None or start_s + dur_s > since_s)
        ]


def _meta(name: str, pid: int, args: dict, tid: int = 0) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def merge_traces(per_rank_events: list[list[dict]]) -> dict:
    """One trace object from `TraceRecorder.events()` of every rank: metadata events first, then
    every other event sorted by `ts` (stable, so equal times keep each rank's order)."""
    owner: dict = {}
    for index, events in enumerate(per_rank_events):
        for pid in {event.get("pid") for event in events}:
            if owner.setdefault(pid, index) != index:
                raise ValueError(
                    f"pid {pid} has events in lists {owner[pid]} and {index}; pass each rank's "
                    "events once"
                )
    merged = [event for events in per_rank_events for event in events]
    merged.sort(key=lambda e: (0, 0.0) if e.get("ph") == "M" else (1, e.get("ts", 0.0)))
    dropped = {
        str(e["pid"]): e["args"]["dropped"]
        for e in merged
        if e.get("ph") == "M" and e.get("name") == _DROPPED
    }
    return {
        "traceEvents": merged,
        "displayTimeUnit": "ms",
        "metadata": {
            "clock": "time.time() in microseconds since the Unix epoch; node skew not corrected",
            "ranks": sorted(pid for pid in owner if isinstance(pid, int)),
            "dropped_events": dropped,
            "num_dropped_events": sum(dropped.values()),
        },
    }


def write_trace(path: str | Path, trace: dict) -> Path:
    """Validate `trace` and write it as JSON (through a temporary file, so never half written)."""
    validate_trace(trace)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(trace, allow_nan=False), encoding="utf-8")
    tmp.replace(path)
    return path


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_trace(obj) -> None:
    """Raise ValueError unless `obj` is a Chrome trace (object or array form) whose events have
    the fields their phase needs with the right types; the message names the event and field."""
    if isinstance(obj, dict):
        if not isinstance(obj.get("traceEvents"), list):
            raise ValueError("trace object needs a 'traceEvents' list")
        unit = obj.get("displayTimeUnit", "ms")
        if unit not in ("ms", "ns"):
            raise ValueError(f"trace displayTimeUnit must be 'ms' or 'ns', got {unit!r}")
        events = obj["traceEvents"]
    elif isinstance(obj, list):
        events = obj
    else:
        raise ValueError(f"a trace is a dict or a list of events, got {type(obj).__name__}")
    for index, event in enumerate(events):
        _validate_event(index, event)


def _validate_event(index: int, event) -> None:
    def bad(field: str, rule: str) -> ValueError:
        value = event.get(field, "<missing>")
        return ValueError(f"trace event {index}: field {field!r} {rule}, got {value!r}")

    if not isinstance(event, dict):
        raise ValueError(f"trace event {index}: must be a dict, got {type(event).__name__}")
    phase = event.get("ph")
    if phase not in _PHASES:
        raise bad("ph", f"must be one of {''.join(sorted(_PHASES))}")
    for field in _COMMON + _REQUIRED.get(phase, ()):
        if field not in event:
            raise bad(field, f"is required for ph={phase!r}")
    if not isinstance(event["name"], str):
        raise bad("name", "must be a string")
    for field in ("pid", "tid"):
        value = event.get(field, "")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad(field, "must be an int or a string")
    for field in ("ts", "dur"):
        if field in event and not _is_number(event[field]):
            raise bad(field, "must be a finite number of microseconds")
    if event.get("dur", 0) < 0:
        raise bad("dur", "must be >= 0")
    if "cat" in event and not isinstance(event["cat"], str):
        raise bad("cat", "must be a string")
    if "args" in event and not isinstance(event["args"], dict):
        raise bad("args", "must be a dict")
    if (
        phase == "M"
        and event["name"].endswith("_name")
        and not isinstance(event["args"].get("name"), str)
    ):
        raise bad("args", f"of {event['name']} needs a string 'name'")
    for field, value in event.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise bad(field, f"must be JSON-serializable ({err})") from None
