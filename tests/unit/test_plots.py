"""Contract of `observability.plots`.

- `plot_reward_curve` writes a PNG for one run, for several runs on one axes (`extra_runs`),
  with a std band and a moving average, and tolerates null values and resumed (repeated) steps.
- `plot_stage_timeline` writes a PNG for spans of several stages on several ranks.
- A missing file, an empty file, a missing key, and malformed spans are ValueErrors naming the
  file and key or the span.

Faked: the runs, written with the real `MetricsWriter` into `tmp_path`. A PNG is checked by its
8-byte signature and its IHDR size (read with `struct`, not matplotlib); the pictures themselves
were checked by eye when the module was written.
"""

import math
import struct

import pytest

from megatron_async_rl.observability.metrics import MetricsWriter, summarize
from megatron_async_rl.observability.plots import (
    _moving_average,
    plot_reward_curve,
    plot_stage_timeline,
    row_label,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _run(run_dir, num_steps=12, slope=0.05):
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        for step in range(num_steps):
            rewards = [slope * step + 0.1 * (i % 3) for i in range(8)]
            writer.log(step, {**summarize(rewards, "reward"), "response/length/mean": 100 + step})
    return run_dir / "metrics.jsonl"


def test_reward_curve_single_run(tmp_path):
    out = plot_reward_curve(_run(tmp_path / "sync"), tmp_path / "plots" / "reward.png")
    width, height = _png_size(out)
    assert width > 200 and height > 100


def test_reward_curve_several_runs_keys_and_smoothing(tmp_path):
    sync, async_ = _run(tmp_path / "sync"), _run(tmp_path / "async", slope=0.08)
    out = plot_reward_curve(
        sync,
        tmp_path / "both.png",
        keys=("reward/mean", "reward/max"),
        title="sync vs async",
        extra_runs={"async": async_},
        moving_average=4,
    )
    assert _png_size(out)[0] > 200


def test_reward_curve_tolerates_nulls_and_resumed_steps(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(0, {"reward/mean": 0.1, "reward/std": 0.05})
        writer.log(1, {"reward/mean": math.nan, "reward/std": math.nan})
        writer.log(2, {"reward/mean": 0.3})  # std missing at this step: no band there
    with MetricsWriter(tmp_path, tensorboard=False) as writer:  # resumed from step 2
        writer.log(2, {"reward/mean": 0.35, "reward/std": 0.1})
    assert _png_size(plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "r.png"))[0] > 0


def test_reward_curve_errors_name_file_and_key(tmp_path):
    path = _run(tmp_path / "run", num_steps=2)
    with pytest.raises(ValueError, match=r"metrics.jsonl has no values for key 'kl/mean'.*reward"):
        plot_reward_curve(path, tmp_path / "x.png", keys=("kl/mean",))
    with pytest.raises(ValueError, match=r"metrics file .*missing.jsonl does not exist"):
        plot_reward_curve(tmp_path / "missing.jsonl", tmp_path / "x.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"metrics file .*empty.jsonl is empty"):
        plot_reward_curve(path, tmp_path / "x.png", extra_runs={"empty": empty})
    with pytest.raises(ValueError, match=r"needs at least one metric key"):
        plot_reward_curve(path, tmp_path / "x.png", keys=())
    with pytest.raises(ValueError, match=r"moving_average must be >= 0 points, got -2"):
        plot_reward_curve(path, tmp_path / "x.png", moving_average=-2)
    assert not (tmp_path / "x.png").exists()


def test_moving_average_is_trailing_and_skips_nan():
    got = _moving_average([1.0, 3.0, math.nan, 5.0, 7.0], 2)
    assert got.tolist() == [1.0, 2.0, 3.0, 5.0, 6.0]


def _spans():
    spans = []
    for step in range(3):
        t = 3.0 * step
        spans += [dict(stage="generate", rank=r, start_s=t, end_s=t + 2.5) for r in (0, 1)]
        spans.append(dict(stage="reward", rank=0, start_s=t + 2.5, end_s=t + 2.7))
        spans.append(dict(stage="train", rank=2, start_s=t + 2.7, end_s=t + 4.5))
    return spans


def test_stage_timeline_png(tmp_path):
    out = plot_stage_timeline(_spans(), tmp_path / "timeline.png", title="async")
    width, height = _png_size(out)
    assert width > 200 and height > 100
    ordered = plot_stage_timeline(
        _spans(), tmp_path / "o.png", stages=["train", "generate", "reward"]
    )
    assert _png_size(ordered)[0] > 0


@pytest.mark.parametrize(
    "spans, kwargs, match",
    [
        ([], {}, r"needs at least one span, got none"),
        ([dict(stage="train", start_s=0, end_s=1)], {}, r"span 0 lacks field\(s\) \['rank'\]"),
        ([dict(stage="train", rank=0, start_s=2, end_s=1)], {}, r"span 0 ends before it starts"),
        (_spans(), {"stages": ["train"]}, r"stages \['generate', 'reward'\] not in stages"),
    ],
)
def test_stage_timeline_rejects_bad_spans(tmp_path, spans, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plot_stage_timeline(spans, tmp_path / "t.png", **kwargs)


def test_timeline_rows_name_their_ranks():
    assert row_label("generate", [1]) == "generate\n(rank 1)"
    assert row_label("train", [0, 2]) == "train\n(ranks 0, 2)"
    assert row_label("logp", list(range(8, 24))) == "logp\n(16 ranks: 8-23)"
