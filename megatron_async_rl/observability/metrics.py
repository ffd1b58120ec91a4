"""Per-step metrics of a run: a JSONL file always, TensorBoard scalars when it is installed,
Weights & Biases when the recipe asks (`observability.wandb`, `wandb_sink.py`).

Owned here: `MetricsWriter` (created by rank 0 only; the driver calls `log(step, metrics)` once
per step), `read_metrics` (tests, benchmarks, `plots.py`) and `summarize` (mean/std/min/max of a
list of per-sample values). Seconds per stage (`timing/<stage>_s`) come from the stage machines'
spans (`observability/clock.py`).

Metric keys follow `<area>/<stage_or_role>/<name>[_unit]`, e.g. `timing/generate_s`,
`timing/weight_sync/send_s`.
`summarize(rewards, "reward")` gives `reward/mean`, `reward/std`, `reward/min`, `reward/max`.

`metrics.jsonl` holds one object per line: `step` first, then the keys sorted; non-finite floats
are written as `null` (warned once per key). Every line is flushed, so a crash loses at most the
line being written, and `read_metrics` tolerates such a truncated last line. A resumed run
appends to the same file.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _summary_writer_class():
    """`torch.utils.tensorboard.SummaryWriter`, or None when `tensorboard` is not importable."""
    try:
        # Checked by name first: torch's module may already sit in sys.modules.
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class MetricsWriter:
    """Append one JSON object per step to `<run_dir>/metrics.jsonl`; mirror to TensorBoard.

    `tensorboard=None` uses TensorBoard when the package is importable, `True` asks for it (a
    warning when it is missing, JSONL still written), `False` never uses it. `enabled=False`
    makes every call a no-op and creates no file.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool | None = None,
                 wandb=None, recipe: dict | None = None):  # fmt: skip
        """`wandb`: a `wandb_sink.WandbConfig` to mirror every record to Weights & Biases
        (`recipe`: the W&B run's config)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_NAME
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._wandb = None
        self._warned_keys: set[str] = set()
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb is not None:
            from megatron_async_rl.observability.wandb_sink import WandbSink

            self._wandb = WandbSink(wandb, self.run_dir, recipe)
        if tensorboard is False:
            return
        writer_cls = _summary_writer_class()
        if writer_cls is not None:
            self._tb = writer_cls(log_dir=str(self.run_dir / TENSORBOARD_DIR))
        elif tensorboard:
            logger.warning(
                "tensorboard=True but the `tensorboard` package is not installed; writing only "
                "%s (fix: pip install 'megatron_async_rl[tensorboard]')",
                self.path,
            )

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        """Write the metrics of one step (one JSONL line, flushed; TensorBoard scalars)."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed; log() after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"metrics step must be an int >= 0, got {step!r}")
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step'; pass it as log(step, ...)")
        record: dict[str, float | int | None] = {"step": step}
        for key in sorted(metrics):
            record[key] = self._clean(key, metrics[key], step)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb_scalars(step, record)
        if self._wandb is not None:
            self._wandb.log(step, record)

    def _tb_scalars(self, step: int, record: dict) -> None:
        """The step's scalars as one TensorBoard event, flushed: `add_scalar` writes an event
        each, 15 ms for a step's ~110 metrics against 1 ms (measured), on the learn leader's
        part of every step. TensorBoard reads it as the same scalars (`test_metrics.py`)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        values = [v for key, value in record.items() if key != "step" and value is not None
                  for v in scalar(key, value).value]  # fmt: skip
        self._tb._get_file_writer().add_summary(Summary(value=values), step)
        self._tb.flush()

    def truncate_from(self, step: int) -> int:
        """Drop the records of steps >= `step` (a resumed run continues at `step`: what a
        crashed run logged after its checkpoint is done again); TensorBoard's events from
        `step` on are purged the same way. Returns the records dropped."""
        if not self.enabled:
            return 0
        self._file.close()
        dropped = truncate_jsonl(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._tb = _summary_writer_class()(
                log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=step
            )
        return dropped

    def _clean(self, key: str, value, step: int) -> float | int | None:
        if hasattr(value, "item"):  # numpy or 0-d torch scalars
            value = value.item()
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        if not isinstance(value, float):
            raise ValueError(
                f"metric {key!r} at step {step} must be a number, got {type(value).__name__} "
                f"{value!r}"
            )
        if math.isfinite(value):
            return value
        if key not in self._warned_keys:
            self._warned_keys.add(key)
            logger.warning(
                "metric %r is %s at step %d; written as null (warned once per key)",
                key,
                value,
                step,
            )
        return None

    def close(self) -> None:
        """Flush and close the JSONL file and the TensorBoard writer; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def truncate_jsonl(path: Path, step: int) -> int:
    """Rewrite a JSONL file of `{"step": ...}` records without those of steps >= `step` (and a
    line cut by a crash); returns how many were dropped."""
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            later = json.loads(line).get("step", -1) >= step
        except ValueError:  # a line cut by the crash
            later = True
        dropped += later
        if not later:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return dropped


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a `metrics.jsonl`, in file order (`null` values come back as None).

    A truncated last line (a crash mid-write) is skipped with a warning; a bad line elsewhere is
    a ValueError naming the file and the line number.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                logger.warning("%s: skipping truncated last line %d (%s)", path, number, err)
                continue
            raise ValueError(f"{path}:{number} is not a JSON object: {err}") from None
    return records


def summarize(values: list[float], prefix: str) -> dict[str, float]:
    """`<prefix>/mean`, `/std` (population), `/min`, `/max` of a non-empty list of numbers."""
    if len(values) == 0:
        raise ValueError(f"summarize(prefix={prefix!r}) needs at least one value, got none")
    values = [float(v) for v in values]
    mean = math.fsum(values) / len(values)
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values)),
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }
