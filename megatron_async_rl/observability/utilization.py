"""How busy each role group is, how much of the pipeline is bubble, and how stale the samples are.

Owned here: pure arithmetic on spans `dict(stage, rank, start_s, end_s)` (from
`StepTimer(record_spans=True)` or `TraceRecorder.spans()`, gathered from every rank by the
caller) and on per-sample policy lags. Rank 0 calls it once per step and logs the result with
`MetricsWriter`; it imports neither torch nor `torch.distributed`.

A rank group is the ranks sharing one `roles.groups` window, named by its roles joined with `+`
(`train+logp`), the same label as the log prefix and the trace's process rows. Keys:

    utilization/<group>/busy_s        mean over the group's ranks of each rank's busy seconds
    utilization/<group>/idle_s        window seconds minus busy_s
    utilization/<group>/bubble_ratio  idle_s / window seconds
    utilization/bubble_ratio          sum of every rank's idle seconds / (num ranks * window),
                                      i.e. the group ratios averaged with weights = ranks per group
    policy_lag/hist/<k>               fraction of samples whose lag is k, k = 0..max_lag

A rank's busy seconds are the length of the union of its spans clipped to the window: two stages
overlapping on one rank (the scheduler thread generating while the main thread trains) count once.
A rank of `roles_of_rank` with no span in the window is idle for all of it.

`ideal_step_s` and `overlap_efficiency` give the two numbers of the overlap picture; log them as
`utilization/ideal_step_s` and `utilization/overlap_efficiency`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence

_SPAN_FIELDS = ("stage", "rank", "start_s", "end_s")


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals`, overlaps counted once."""
    total, cover_start, cover_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cover_end is None or start > cover_end:
            if cover_end is not None:
                total += cover_end - cover_start
            cover_start, cover_end = start, end
        else:
            cover_end = max(cover_end, end)
    if cover_end is not None:
        total += cover_end - cover_start
    return total


def busy_idle(
    spans: Sequence[Mapping],
    window_start_s: float,
    window_end_s: float,
    roles_of_rank: Mapping[int, Sequence[str]],
) -> dict[str, float]:
    """Busy and idle seconds and bubble ratio per rank group over `[window_start_s, window_end_s)`.

    `roles_of_rank` maps every rank to its roles (`RoleLayout.roles_of_rank`); its ranks are the
    ones counted, so a rank that recorded nothing counts as idle. Spans and window share a clock.
    """
    window_s = window_end_s - window_start_s
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(
            f"busy_idle needs window_start_s < window_end_s, got {window_start_s!r} and "
            f"{window_end_s!r}"
        )
    if not roles_of_rank:
        raise ValueError("busy_idle needs roles_of_rank for at least one rank, got none")
    intervals: dict[int, list[tuple[float, float]]] = {rank: [] for rank in roles_of_rank}
    for index, span in enumerate(spans):
        missing = [field for field in _SPAN_FIELDS if field not in span]
        if missing:
            raise ValueError(f"span {index} lacks field(s) {missing}: {span}")
        if span["end_s"] < span["start_s"]:
            raise ValueError(f"span {index} ends before it starts: {span}")
        if span["rank"] not in intervals:
            raise ValueError(
                f"span {index} is on rank {span['rank']!r}, which roles_of_rank does not list "
                f"(ranks {sorted(intervals)}): {span}"
            )
        start, end = max(span["start_s"], window_start_s), min(span["end_s"], window_end_s)
        if end > start:
            intervals[span["rank"]].append((start, end))

    busy_by_group: dict[str, list[float]] = {}
    for rank in sorted(intervals):
        group = "+".join(roles_of_rank[rank]) or f"rank{rank}"
        busy_by_group.setdefault(group, []).append(_union_length(intervals[rank]))
    metrics: dict[str, float] = {}
    total_idle_s = 0.0
    for group, busy in busy_by_group.items():
        busy_s = math.fsum(busy) / len(busy)
        idle_s = window_s - busy_s
        total_idle_s += idle_s * len(busy)
        metrics[f"utilization/{group}/busy_s"] = busy_s
        metrics[f"utilization/{group}/idle_s"] = idle_s
        metrics[f"utilization/{group}/bubble_ratio"] = idle_s / window_s
    metrics["utilization/bubble_ratio"] = total_idle_s / (len(intervals) * window_s)
    return metrics


def ideal_step_s(per_group_busy_s: Mapping[str, float]) -> float:
    """The step time of a perfectly overlapped pipeline: the largest busy seconds of any group.

    Every group works at once in the ideal async pipeline, so a step cannot end before its
    busiest group is done. Keys only label errors: a group name or a `.../busy_s` metric key.
    """
    if not per_group_busy_s:
        raise ValueError("ideal_step_s needs the busy seconds of at least one group, got none")
    for group, busy_s in per_group_busy_s.items():
        if not (math.isfinite(busy_s) and busy_s >= 0):
            raise ValueError(f"busy seconds of {group!r} must be finite and >= 0, got {busy_s!r}")
    return max(per_group_busy_s.values())


def overlap_efficiency(ideal_s: float, actual_step_s: float) -> float:
    """`ideal_s / actual_step_s`: 1.0 when the step took only as long as its busiest group.

    Below 1 the difference is time the busiest group waited (bubble on the critical path).
    """
    if not (math.isfinite(actual_step_s) and actual_step_s > 0):
        raise ValueError(f"actual_step_s must be finite and > 0, got {actual_step_s!r}")
    if not (math.isfinite(ideal_s) and 0 <= ideal_s <= actual_step_s * (1 + 1e-9)):
        raise ValueError(
            f"ideal_s must be in [0, actual_step_s={actual_step_s!r}] (a group cannot be busy "
            f"longer than the step; measure both over the same window), got {ideal_s!r}"
        )
    return min(ideal_s / actual_step_s, 1.0)


def policy_lag_histogram(lags: Sequence[int], max_lag: int) -> dict[str, float]:
    """Fraction of samples per policy lag (trainer version minus generating version).

    Every key `policy_lag/hist/0` .. `policy_lag/hist/<max_lag>` is present (0.0 when empty) so
    curves stay continuous; the last bucket also collects lags above `max_lag`. Fractions sum
    to 1.
    """
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")
    if len(lags) == 0:
        raise ValueError("policy_lag_histogram needs at least one lag, got none")
    counts = [0] * (max_lag + 1)
    for index, lag in enumerate(lags):
        try:
            value = -1 if isinstance(lag, bool) else operator.index(lag)  # numpy ints pass
        except TypeError:
            value = -1
        if value < 0:
            raise ValueError(f"lag {index} must be an int >= 0 (policy versions), got {lag!r}")
        counts[min(value, max_lag)] += 1
    return {f"policy_lag/hist/{k}": count / len(lags) for k, count in enumerate(counts)}
