"""Weights & Biases as a metrics sink (`observability/wandb_sink.py`), in W&B's offline mode.

Contract: with `observability.wandb: {project, mode: offline}` the leader's `MetricsWriter`
mirrors every record to a real W&B run (non-finite values left out, like TensorBoard), whose
config is the recipe; the run's files are under `<run_dir>/wandb/`; a second writer in the same
run directory (a resumed run) continues the same W&B run id and skips steps W&B already has;
bad `observability.wandb` sections are one ConfigError naming the key. Real `wandb`, offline.
"""

from __future__ import annotations

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.observability.config import ObservabilityConfig, WandbConfig
from megatron_async_rl.observability.metrics import MetricsWriter
from megatron_async_rl.observability.wandb_sink import RUN_ID_NAME

pytest.importorskip(
    "wandb"
)  # an extra: `pip install 'megatron_async_rl[wandb]'` (the suite has it)


def test_offline_run_mirrors_the_metrics_and_resumes_its_id(tmp_path):
    config = WandbConfig(project="unit", mode="offline", tags=["t"])
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb=config, recipe={"seed": 7})
    run = writer._wandb.run
    for step in range(3):
        writer.log(step, {"reward/mean": 0.5 * step, "bad": float("nan")})
    assert run.summary["reward/mean"] == 1.0 and "bad" not in run.summary.keys()
    assert run.config["seed"] == 7 and run.tags == ("t",)
    run_id = run.id
    writer.close()
    assert (tmp_path / RUN_ID_NAME).read_text().strip() == run_id
    files = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files and files[0].stat().st_size > 0

    resumed = MetricsWriter(tmp_path, tensorboard=False, wandb=config, recipe={"seed": 7})
    assert resumed._wandb.run.id == run_id
    resumed._wandb._last_step = 2  # what W&B reports for a run it has synced up to step 2
    resumed.log(1, {"reward/mean": 9.0})  # redone after a crash: W&B keeps its first value
    resumed.log(3, {"reward/mean": 2.0})
    assert resumed._wandb.run.summary["reward/mean"] == 2.0
    resumed.close()


@pytest.mark.parametrize(
    "section, match",
    [
        ({"mode": "offline"}, r"wandb.project = None|wandb.project = ''"),
        ({"project": "p", "mode": "cloud"}, r"wandb.mode = 'cloud'"),
        ({"project": "p", "projct": "q"}, r"wandb.projct .*did you mean project"),
        ({"project": "p", "tags": "a"}, r"wandb.tags = 'a'"),
    ],
)
def test_bad_sections_name_the_key(section, match):
    with pytest.raises(ConfigError, match=match):
        ObservabilityConfig(wandb=section)
