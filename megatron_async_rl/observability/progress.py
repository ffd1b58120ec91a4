"""The leader's step progress: a tqdm bar on a terminal, one log line per step otherwise.

Owned here: `Progress`, made by the driver on every rank with `enabled=(rank == 0)` and fed the
metrics dict of each finished step. On a TTY (or with `bar=True`) a tqdm bar on stderr shows a
few metrics compactly, with tqdm's elapsed time and ETA; elsewhere (CI, `nohup`, `bar=False`)
each step is one INFO line, `step 3/20 reward/mean=0.41 response/length/mean=212
timing/step_s=3.9 eta=1m06s`, so logs stay readable. `sample` shows one sample (prompt,
response, answer, reward) above the bar or as a line (`observability.show_sample_every`).

Steps are counted from 0 as in `metrics.jsonl`; the display shows steps done, `step + 1`.
"""

from __future__ import annotations

import logging
import sys
import time
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
        self._started: tuple[float, int] | None = None
        """(when, first step) of the pace ETA reads: set by the first `update`, back-dated by
        that step's own `timing/step_s`, so start-up (engines, checkpoints) is not counted."""
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
        if self._started is None:
            step_s = metrics.get("timing/step_s")
            took = float(step_s) if isinstance(step_s, (int, float)) and step_s > 0 else 0.0
            self._started = (time.monotonic() - took, step)
        shown = [(key, label) for key, label in self.keys.items() if key in metrics]
        if self._bar is None:
            parts = [f"{key}={_format(metrics[key])}" for key, _ in shown]
            parts.append(f"eta={self.eta(step)}")
            logger.info("step %d/%d %s", step + 1, self.total_steps, " ".join(parts))
            return
        self._bar.set_postfix_str(
            " | ".join(f"{label} {_format(metrics[key])}" for key, label in shown), refresh=False
        )
        self._bar.update(step + 1 - self._bar.n)

    def eta(self, step: int) -> str:
        """Time left after step `step` (0-based) at the mean pace since the start, `1h02m`,
        `4m05s` or `12s`."""
        if self._started is None:
            return "?"
        began, first = self._started
        done = step + 1 - first
        left = self.total_steps - (step + 1)
        if done < 1:
            return "?"
        seconds = int(round((time.monotonic() - began) / done * left))
        hours, rest = divmod(seconds, 3600)
        minutes, seconds = divmod(rest, 60)
        if hours:
            return f"{hours}h{minutes:02d}m"
        return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"

    def sample(self, step: int, prompt: str | None, response: str, answer, reward: float,
               width: int = 160) -> None:  # fmt: skip
        """One sample of step `step`, on one line: above the bar, or as an INFO line."""
        if not self.enabled:
            return

        def short(text) -> str:
            text = " ".join(str(text).split())
            return text if len(text) <= width else text[: width - 3] + "..."

        line = (f"sample of step {step + 1}: {short(prompt or '')!r} -> {short(response)!r} "
                f"(answer {short(answer)!r}, reward {_format(reward)})")  # fmt: skip
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            logger.info("%s", line)

    def close(self) -> None:
        """Finish the bar (leaves it on screen); safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
