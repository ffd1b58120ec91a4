"""Weights & Biases as a third place the per-step metrics go (`observability.wandb`).

Owned here: `WandbSink`, which `MetricsWriter` feeds the same records it writes to
metrics.jsonl and TensorBoard, on the leader only. Its settings: `observability.config.
WandbConfig` (the recipe's `observability.wandb: {project, mode, entity, name, tags}`).
The W&B run is tied to the run directory
(`<run_dir>/wandb_run_id`), so a resumed run continues the same W&B run; W&B keeps the first
value it got for a step, so steps a crashed run logged after its checkpoint keep their first
values there (metrics.jsonl and TensorBoard drop and redo them). The resolved recipe
(`<run_dir>/config.resolved.yaml`) is the W&B run's config. `mode: offline` writes under
`<run_dir>/wandb/` for `wandb sync` later.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.observability.config import WandbConfig

logger = logging.getLogger(__name__)

RUN_ID_NAME = "wandb_run_id"
RECIPE_NAME = "config.resolved.yaml"  # written by the entry point before the job starts


class WandbSink:
    """One W&B run for one run directory; `log(step, record)` and `close()`."""

    def __init__(self, config: WandbConfig, run_dir: str | Path, recipe: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "observability.wandb", config.project, "needs the `wandb` package",
                "pip install 'megatron_async_rl[wandb]', or remove observability.wandb",
            ) from None  # fmt: skip
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_NAME
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        if recipe is None and (run_dir / RECIPE_NAME).exists():
            import yaml

            recipe = yaml.safe_load((run_dir / RECIPE_NAME).read_text())
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=config.project, entity=config.entity, mode=config.mode,
            name=config.name or run_dir.resolve().name, tags=config.tags or None,
            dir=str(run_dir), id=run_id, resume="allow", config=recipe or {},
            settings=wandb.Settings(console="off", quiet=True, silent=True),
        )  # fmt: skip
        self._last_step = getattr(self.run, "step", 0) or 0
        logger.info("W&B run %s (%s, project %s) logs this run's metrics", run_id, config.mode,
                    config.project)  # fmt: skip

    def log(self, step: int, record: dict) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        if step < self._last_step:  # W&B refuses steps below its last: kept as first logged
            return
        self.run.log(values, step=step, commit=True)
        self._last_step = step

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
