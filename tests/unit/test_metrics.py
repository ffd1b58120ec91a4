"""Contract of `observability.metrics` and `observability.progress`.

- `MetricsWriter.log` writes one flushed JSONL line per step, `step` first then keys sorted,
  non-finite floats as null with one warning per key; `read_metrics` round-trips it and skips a
  truncated last line; misuse (bad step, non-numeric value, log after close) raises.
- With `tensorboard` installed, scalars land in `<run_dir>/tensorboard` (read back with
  TensorBoard's own event reader); asked for but missing, a warning and JSONL only.
- `summarize`
  matches the formula. `Progress` logs one line per step when no bar is drawn.

Faked: a missing `tensorboard` package (None in
`sys.modules`). Everything else is real, in `tmp_path`.
"""

import logging
import math
import sys

import pytest

from megatron_async_rl.observability.metrics import (
    MetricsWriter,
    read_metrics,
    summarize,
)
from megatron_async_rl.observability.progress import Progress


def test_jsonl_round_trip_with_non_finite_values(tmp_path, caplog):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(0, {"z/last": 1, "a/first": 0.5, "loss/nan": math.nan})
        # Flushed per line: readable before close.
        assert read_metrics(writer.path) == [
            {"step": 0, "a/first": 0.5, "loss/nan": None, "z/last": 1}
        ]
        writer.log(1, {"a/first": math.inf, "loss/nan": math.nan, "z/last": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == '{"step": 0, "a/first": 0.5, "loss/nan": null, "z/last": 1}'
    assert read_metrics(tmp_path / "metrics.jsonl")[1] == {
        "step": 1,
        "a/first": None,
        "loss/nan": None,
        "z/last": 1,
    }
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned  # once for loss/nan, once for a/first
    assert "'loss/nan' is nan at step 0" in warned[0]


def test_scalar_objects_and_append_on_resume(tmp_path):
    torch = pytest.importorskip("torch")
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(0, {"x": torch.tensor(2.5)})
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(1, {"x": 3})
    assert [r["x"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2.5, 3]


def test_truncated_last_line_is_skipped_bad_middle_line_raises(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x"')
    assert read_metrics(path) == [{"step": 0, "x": 1}]
    path.write_text('{"step": 0, "x": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON object"):
        read_metrics(path)


@pytest.mark.parametrize(
    "step, metrics, match",
    [
        (-1, {}, r"step must be an int >= 0, got -1"),
        (1.0, {}, r"step must be an int >= 0, got 1.0"),
        (0, {"step": 3}, r"must not contain the key 'step'"),
        (0, {"name": "x"}, r"metric 'name' at step 0 must be a number, got str"),
    ],
)
def test_log_rejects_bad_input(tmp_path, step, metrics, match):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match=match):
            writer.log(step, metrics)


def test_log_after_close_and_disabled_writer(tmp_path):
    writer = MetricsWriter(tmp_path / "on", tensorboard=False)
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match=r"is closed; log\(\) after close\(\)"):
        writer.log(0, {"x": 1.0})
    off = MetricsWriter(tmp_path / "off", enabled=False)
    off.log(0, {"x": 1.0})
    off.close()
    assert not (tmp_path / "off").exists()


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, tensorboard=None) as writer:
        for step in range(3):
            writer.log(step, {"reward/mean": 0.25 * step, "loss/nan": math.nan,
                              "actor/optimizer_steps": step + 1, "flag": step == 1})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    # null values are not sent; a step's scalars go as one event, read back as each scalar's
    assert sorted(acc.Tags()["scalars"]) == ["actor/optimizer_steps", "flag", "reward/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0), (1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("actor/optimizer_steps")] == [
        (0, 1), (1, 2), (2, 3)]
    assert [e.value for e in acc.Scalars("flag")] == [0, 1, 0]


def test_tensorboard_resume_purges_the_steps_done_again(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, tensorboard=None) as writer:
        for step in range(4):
            writer.log(step, {"reward/mean": float(step), "timing/step_s": 1.0})
        assert writer.truncate_from(2) == 2
        for step in (2, 3):
            writer.log(step, {"reward/mean": 10.0 + step, "timing/step_s": 2.0})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [
        (0, 0), (1, 1), (2, 12), (3, 13)]
    assert [e.value for e in acc.Scalars("timing/step_s")] == [1, 1, 2, 2]


def test_tensorboard_requested_but_missing_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.log(0, {"x": 1.0})
    assert "tensorboard=True but the `tensorboard` package is not installed" in caplog.text
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(writer.path) == [{"step": 0, "x": 1.0}]


def test_summarize_matches_formula():
    got = summarize([1, 2, 3, 4], "reward")
    assert got == {
        "reward/mean": 2.5,
        "reward/std": math.sqrt(1.25),  # population std: mean of squared deviations
        "reward/min": 1.0,
        "reward/max": 4.0,
    }
    with pytest.raises(ValueError, match=r"summarize\(prefix='reward'\) needs at least one value"):
        summarize([], "reward")


def test_progress_logs_one_line_per_step_without_tty(caplog):
    caplog.set_level(logging.INFO, logger="megatron_async_rl.observability.progress")
    with Progress(total_steps=20, enabled=True, bar=False) as progress:
        progress.update(2, {"reward/mean": 0.41, "timing/step_s": 3.9, "other": 1.0})
        progress.update(3, {"reward/mean": None})
    lines = [r.getMessage() for r in caplog.records]
    # the pace starts at the first step reported, back-dated by its own 3.9 s: 17 left
    assert lines == ["step 3/20 reward/mean=0.41 timing/step_s=3.9 eta=1m06s",
                     "step 4/20 reward/mean=nan eta=31s"]  # fmt: skip


def test_progress_eta_and_sample_lines(caplog, capsys):
    import time

    caplog.set_level(logging.INFO, logger="megatron_async_rl.observability.progress")
    progress = Progress(total_steps=20, enabled=True, bar=False, start_step=4)
    assert progress.eta(9) == "?"  # no step reported yet: no pace
    progress.update(4, {"timing/step_s": 50.0})  # the first step reported: 50 s
    assert progress.eta(4) == "12m30s"  # 15 left at 50 s
    progress._started = (time.monotonic() - 300.0, 4)  # 6 steps (4..9) took 300 s
    assert progress.eta(9) == "8m20s"  # 10 steps left at 50 s
    progress._started = (time.monotonic() - 3 * 3600.0, 4)
    assert progress.eta(9) == "5h00m"
    progress.sample(9, "3+5=", "8", "8", 1.0)
    progress.sample(9, None, "x" * 500, 7, 0.0, width=20)
    lines = [r.getMessage() for r in caplog.records][1:]
    assert lines[0] == "sample of step 10: '3+5=' -> '8' (answer '8', reward 1)"
    assert "'" + "x" * 17 + "...'" in lines[1] and "(answer '7', reward 0)" in lines[1]
    with Progress(total_steps=5, enabled=True, bar=True) as bar:
        bar.sample(0, "p", "r", "a", 0.5)
    assert "sample of step 1: 'p' -> 'r'" in capsys.readouterr().err


def test_progress_disabled_is_silent_and_bar_goes_to_stderr(caplog, capsys):
    caplog.set_level(logging.INFO)
    Progress(total_steps=5, enabled=False, bar=True).update(0, {"reward/mean": 1.0})
    assert caplog.records == [] and capsys.readouterr().err == ""
    with Progress(total_steps=5, enabled=True, bar=True) as progress:
        progress.update(1, {"reward/mean": 0.5, "response/length/mean": 120})
    err = capsys.readouterr().err
    assert "2/5" in err and "reward 0.5 | len 120" in err
    assert caplog.records == []
    with pytest.raises(ValueError, match=r"total_steps must be >= 1, got 0"):
        Progress(total_steps=0)
