"""Bounded off-policy: how far generation may run ahead of training, admitted and enforced.

Owned here: `StalenessController`. Versions count optimizer steps (the initial weights are
version 0; train step k turns version k into k + 1), and every generated token carries the
version of the weights that produced it. With `generate_ahead_steps = N`:

- Admission (the generate stage, before it starts a step's batch): generation of the samples for
  train step k may start only once the engines hold version >= k - N (`can_generate`). The
  engines can never hold a version newer than k while step k is still to be trained, so every
  token of those samples then lies in the window [k - N, k], in-flight weight updates included.
- Enforcement (the train stage, where samples are consumed): `check_batch` rejects a batch with
  any token outside [k - N, k] with a RuntimeError naming the step, the sample, the version and
  the window, so the bound is never silently broken; otherwise it returns lag metrics.

N = 0 is the synchronous trainer: step k's samples come from version k alone.

Metrics (lag = k - version, per token): `policy_lag/max`, `policy_lag/mean`,
`policy_lag/hist/<lag>` for lag 0..N (fractions of the tokens, summing to 1; every key present
so the series are continuous) and `policy_lag/mixed_samples` (samples whose tokens span more
than one version, which only in-flight updates produce).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megatron_async_rl.config.checks import require_int

KEY = "scheduler.generate_ahead_steps"


class StalenessController:
    """Admission and enforcement of the window [k - N, k] of policy versions for train step k."""

    def __init__(self, generate_ahead_steps: int):
        require_int(KEY, generate_ahead_steps, 0, hint="0 is synchronous")
        self.generate_ahead_steps = generate_ahead_steps

    def window(self, step: int) -> tuple[int, int]:
        """The versions (lowest, highest) the samples trained at `step` may come from."""
        return max(0, step - self.generate_ahead_steps), step

    def required_version(self, step: int) -> int:
        """The oldest engine version allowed to start generating the samples for `step`."""
        return self.window(step)[0]

    def last_admissible_step(self, engine_version: int) -> int:
        """The furthest train step whose samples engines at `engine_version` may generate."""
        return engine_version + self.generate_ahead_steps

    def can_generate(self, step: int, engine_version: int) -> bool:
        """Whether generation of the samples for train `step` may start on engines holding
        `engine_version`. Raises RuntimeError if the engines are already past `step`: its
        samples could then only carry versions outside the window, so waiting cannot help."""
        if step < 0 or engine_version < 0:
            raise RuntimeError(f"step {step}, engine version {engine_version}: must be >= 0")
        if engine_version > step:
            raise RuntimeError(
                f"generate for train step {step}: engines hold policy version {engine_version}, "
                f"newer than the step; its samples must come from versions in "
                f"{list(self.window(step))} (a scheduler bug: weights were updated before "
                f"step {step} was generated)"
            )
        return engine_version >= self.required_version(step)

    def check_batch(self, step: int, token_versions: Sequence[Sequence[int]]) -> dict[str, float]:
        """Check every token version of the samples trained at `step` (one list per sample, one
        version per generated token) against the window; return the lag metrics. A batch with
        no tokens gives zero lags and an all-zero histogram."""
        low, high = self.window(step)
        counts: Counter[int] = Counter()
        mixed = 0
        for index, versions in enumerate(token_versions):
            sample = Counter(int(v) for v in versions)
            if not sample:
                continue
            oldest, newest = min(sample), max(sample)
            if oldest < low or newest > high:
                bad = oldest if oldest < low else newest
                why = (
                    f"lag {step - bad} > generate_ahead_steps {self.generate_ahead_steps}"
                    if bad < low
                    else "newer than the weights being trained"
                )
                raise RuntimeError(
                    f"train step {step}: sample {index} has a token from policy version {bad}, "
                    f"outside the window [{low}, {high}] ({why}; {KEY} = "
                    f"{self.generate_ahead_steps})"
                )
            mixed += len(sample) > 1
            counts.update(sample)
        return self._lag_metrics(step, counts, mixed)

    def _lag_metrics(self, step: int, counts: Counter[int], mixed: int) -> dict[str, float]:
        lags = {step - version: n for version, n in counts.items()}
        num_tokens = sum(lags.values())
        metrics = {
            "policy_lag/max": float(max(lags, default=0)),
            "policy_lag/mean": sum(lag * n for lag, n in lags.items()) / num_tokens
            if num_tokens
            else 0.0,
            "policy_lag/mixed_samples": float(mixed),
        }
        for lag in range(self.generate_ahead_steps + 1):
            share = lags.get(lag, 0) / num_tokens if num_tokens else 0.0
            metrics[f"policy_lag/hist/{lag}"] = share
        return metrics

    def __repr__(self) -> str:
        return f"StalenessController(generate_ahead_steps={self.generate_ahead_steps})"
