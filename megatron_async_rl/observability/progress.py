"""The leader's step progress: a tqdm bar on a terminal, one log line per step otherwise.

Owned here: `Progress`, made by the driver on every rank with `enabled=(rank == 0)` and fed the
metrics dict of each finished step. On a TTY (or with `bar=True`) a tqdm bar on stderr shows a
few metrics compactly; elsewhere (CI, `nohup`, `bar=False`) each step is one INFO line,
`step 3/20 reward/mean=0.41 response/length/mean=212 timing/step_s=3.9`, so logs stay readable.

Steps are counted from 0 as in `metrics.jsonl`; the display shows steps done, `step + 1`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

from tqdm import tqdm

logger = logging.getLogger(__name__)

# Metric key -> short label in the bar. Keys absent from a step's metrics are left out.
DEFAULT_KEYS: dict[str, str] = {
    "reward/mean": "reward",
    "response/length/mean": "len",
    "timing/step_s": "s/step",
}


def _format(value) -> str:
    if value is None:
        return "nan"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """Step progress of the leader. `bar=None` draws a bar only when stderr is a TTY."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        bar: bool | None = None,
        keys: Mapping[str, str] | None = None,
        start_step: int = 0,
    ):
        if total_steps < 1:
            raise ValueError(f"Progress total_steps must be >= 1, got {total_steps}")
        self.total_steps = total_steps
        self.enabled = enabled
        self.keys = dict(DEFAULT_KEYS if keys is None else keys)
        use_bar = sys.stderr.isatty() if bar is None else bar
        self._bar = None
        if enabled and use_bar:
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=sys.stderr,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            )

    def update(self, step: int, metrics: Mapping[str, float | int | None]) -> None:
        """Report that step `step` (0-based) finished with these metrics."""
        if not self.enabled:
            return
        shown = [(key, label) for key, label in self.keys.items() if key in metrics]
        if self._bar is None:
            parts = [f"{key}={_format(metrics[key])}" for key, _ in shown]
            logger.info("step %d/%d %s", step + 1, self.total_steps, " ".join(parts))
            return
        self._bar.set_postfix_str(
            " | ".join(f"{label} {_format(metrics[key])}" for key, label in shown), refresh=False
        )
        self._bar.update(step + 1 - self._bar.n)

    def close(self) -> None:
        """Finish the bar (leaves it on screen); safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
