"""PNG pictures of a run: the reward curve and the stage timeline.

Owned here: `plot_reward_curve` (one or more `metrics.jsonl` files on one axes, e.g. a sync and
an async run) and `plot_stage_timeline` (one row per stage, a bar per span, showing how stages
overlap in the async pipeline). Called by rank 0 at the end of a run and by benchmark scripts.

Figures are drawn on a bare `matplotlib.figure.Figure` rendered by Agg: no pyplot, no display,
no change to the process-wide backend.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import rcParams
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_async_rl.observability.metrics import read_metrics

_DPI = 120
_LINE_STYLES = ("-", "--", ":", "-.")


def _load(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"metrics file {path} does not exist")
    records = read_metrics(path)
    if not records:
        raise ValueError(f"metrics file {path} is empty; it has no metric keys to plot")
    return records


def _series(records: list[dict], path: Path, key: str) -> dict[int, float]:
    """Step -> value of `key` (null -> NaN); the last record of a step wins (resume appends)."""
    by_step = {
        r["step"]: math.nan if r[key] is None else float(r[key]) for r in records if key in r
    }
    if not by_step:
        present = sorted({k for record in records for k in record} - {"step"})
        raise ValueError(
            f"metrics file {path} has no values for key {key!r}; keys present: {present}"
        )
    return dict(sorted(by_step.items()))


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` points, ignoring NaN (NaN where all are NaN)."""
    values = np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _tidy(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)


def plot_reward_curve(
    metrics_jsonl: Path,
    out_png: Path,
    keys: Sequence[str] = ("reward/mean",),
    title: str | None = None,
    extra_runs: dict[str, Path] | None = None,
    run_label: str | None = None,
    std_band: bool = True,
    moving_average: int = 0,
) -> Path:
    """Draw `keys` against step for `metrics_jsonl` (and every `extra_runs` label -> file).

    A `<x>/mean` key gets a shaded ±1 std band from `<x>/std` when that key is logged and
    `std_band` is on. `moving_average > 1` draws the raw curve faintly under a trailing mean of
    up to that many points (at most a fifth of the run's steps, so a short run is not flattened;
    none under 10 steps). `run_label` defaults to the run directory's name. Returns `out_png`.
    """
    if not keys:
        raise ValueError("plot_reward_curve needs at least one metric key, got keys=()")
    if moving_average < 0:
        raise ValueError(f"moving_average must be >= 0 points, got {moving_average}")
    metrics_jsonl = Path(metrics_jsonl)
    runs = {run_label or metrics_jsonl.parent.name or "run": metrics_jsonl}
    runs.update({label: Path(p) for label, p in (extra_runs or {}).items()})

    fig = Figure(figsize=(8, 4.5), dpi=_DPI, layout="constrained")
    ax = fig.subplots()
    colors = itertools.cycle(rcParams["axes.prop_cycle"].by_key()["color"])
    # One color per run, one line style per key: a sync and an async run read apart at a glance.
    for (label, path), color in zip(runs.items(), colors):
        records = _load(path)
        for key, style in zip(keys, itertools.cycle(_LINE_STYLES)):
            by_step = _series(records, path, key)
            steps = np.array(list(by_step), dtype=float)
            values = np.array(list(by_step.values()))
            name = key if len(runs) == 1 else label if len(keys) == 1 else f"{label}: {key}"
            # a window of at most a fifth of the run: a short run's curve is not flattened
            window = min(moving_average, len(values) // 5)
            smooth = window > 1
            ax.plot(
                steps,
                values,
                color=color,
                lw=1.2,
                ls=style,
                alpha=0.35 if smooth else 1.0,
                marker="o" if len(steps) <= 30 else None,
                ms=3,
                label=None if smooth else name,
            )
            if smooth:
                ax.plot(
                    steps,
                    _moving_average(values, window),
                    color=color,
                    lw=2,
                    ls=style,
                    label=f"{name} (avg of {window})",
                )
            std_key = key.removesuffix("/mean") + "/std"
            if std_band and key.endswith("/mean") and any(std_key in r for r in records):
                std_by_step = _series(records, path, std_key)
                std = np.array([std_by_step.get(step, math.nan) for step in by_step])
                ax.fill_between(steps, values - std, values + std, color=color, alpha=0.15, lw=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ylabel = keys[0] if len(keys) == 1 else "value"
    _tidy(ax, "step", ylabel, title or ("reward" if len(runs) > 1 else next(iter(runs))))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


def row_label(stage: str, ranks: list) -> str:
    """A timeline row's label: the stage and its ranks (lanes run top to bottom in rank
    order), named when few, else counted."""
    if len(ranks) == 1:
        return f"{stage}\n(rank {ranks[0]})"
    if len(ranks) <= 4:
        return f"{stage}\n(ranks {', '.join(map(str, ranks))})"
    return f"{stage}\n({len(ranks)} ranks: {ranks[0]}-{ranks[-1]})"


def plot_stage_timeline(
    spans: list[dict],
    out_png: Path,
    title: str | None = None,
    stages: Sequence[str] | None = None,
) -> Path:
    """One row per stage (top to bottom in order of first start, or `stages`), one bar per span.

    Each span is `dict(stage, rank, start_s, end_s)`. A stage seen on several ranks splits its
    row into one thin lane per rank. x is seconds since the earliest span. Returns `out_png`.
    """
    if not spans:
        raise ValueError("plot_stage_timeline needs at least one span, got none")
    for index, span in enumerate(spans):
        missing = [f for f in ("stage", "rank", "start_s", "end_s") if f not in span]
        if missing:
            raise ValueError(f"span {index} lacks field(s) {missing}: {span}")
        if span["end_s"] < span["start_s"]:
            raise ValueError(f"span {index} ends before it starts: {span}")
    by_start = sorted(spans, key=lambda s: s["start_s"])
    order = list(dict.fromkeys(stages or [s["stage"] for s in by_start]))
    unknown = {s["stage"] for s in spans} - set(order)
    if unknown:
        raise ValueError(f"spans have stages {sorted(unknown)} not in stages={list(order)}")
    origin = by_start[0]["start_s"]
    end = max(s["end_s"] for s in spans) - origin

    fig = Figure(figsize=(9, 0.7 * len(order) + 1.4), dpi=_DPI, layout="constrained")
    ax = fig.subplots()
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    labels = []
    for row, stage in enumerate(order):
        ranks = sorted({s["rank"] for s in spans if s["stage"] == stage})
        lane = 0.8 / max(len(ranks), 1)
        for i, rank in enumerate(ranks):
            bars = [
                (s["start_s"] - origin, s["end_s"] - s["start_s"])
                for s in spans
                if s["stage"] == stage and s["rank"] == rank
            ]
            ax.broken_barh(
                bars,
                (row - 0.4 + i * lane, lane * 0.9),
                facecolors=colors[row % len(colors)],
                edgecolor="white",
                lw=0.5,
            )
        labels.append(row_label(stage, ranks))
    ax.set_yticks(range(len(order)), labels)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.02 if end > 0 else 1.0)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="y", length=0)
    _tidy(ax, "seconds", "", title or "stage timeline")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png
