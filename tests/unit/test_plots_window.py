"""reward.png's trailing mean adapts to short runs (`plot_reward_curve`).

Contract: the smoothing window is at most a fifth of the run's steps (none under 10 steps), so
a 20-step run is averaged over 4 points, not 10, and the legend says which. Reads the PNG's
legend text through matplotlib's own figure (no image comparison).
"""

import json

from megatron_async_rl.observability import plots


def test_window_is_at_most_a_fifth_of_the_run(tmp_path, monkeypatch):
    labels = []
    original = plots.Figure.savefig

    def record(fig, path, *a, **k):
        labels.extend(t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts())
        return original(fig, path, *a, **k)

    monkeypatch.setattr(plots.Figure, "savefig", record)
    for steps, expected in ((20, "(avg of 4)"), (100, "(avg of 10)")):
        metrics = tmp_path / f"m{steps}.jsonl"
        metrics.write_text("".join(json.dumps({"step": i, "reward/mean": i / steps}) + "\n"
                                   for i in range(steps)))  # fmt: skip
        plots.plot_reward_curve(metrics, tmp_path / f"r{steps}.png", moving_average=10)
        assert labels[-1].endswith(expected), labels
    metrics = tmp_path / "m8.jsonl"
    metrics.write_text(
        "".join(json.dumps({"step": i, "reward/mean": 0.5}) + "\n" for i in range(8))
    )
    plots.plot_reward_curve(metrics, tmp_path / "r8.png", moving_average=10)
    assert "avg of" not in labels[-1]
