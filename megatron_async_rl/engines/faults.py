"""Faults injected on purpose into the engines, to prove recovery (tests and soak scripts).

Owned here: the recipe's `faults:` section (`FaultsConfig`: off by default, refused unless
`faults.allow: true`) and `EngineFaults`, the hook `engines.restarting.RestartingEngine` calls
when a step's generation starts and when a weight load begins. It signals the engine's
scheduler process as a real fault would: SIGKILL (a crash) or SIGSTOP (a hang), during
generation after `delay_s`, or right after a weight load began (a transfer that dies half way).
Each fault is injected once per (kind, step), also when the step's generation is carried on
by a restarted engine; with several engines, into engine `step % num_engines` only. Counted
as `faults/injected/engine_kill`, `.../engine_hang`, `.../engine_kill_in_load`. Pure of torch
and sglang (the recipe loader imports the config).
"""

from __future__ import annotations

import logging
import random
import signal
import threading
from dataclasses import dataclass, field

from megatron_async_rl.config.checks import require_number
from megatron_async_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class FaultsConfig:
    """Faults to inject (all off by default)."""

    allow: bool = False
    """Must be true for any fault below: a recipe never injects one by accident."""
    engine_kill_steps: list[int] = field(default_factory=list)
    """Steps whose generation gets its engine's scheduler killed (SIGKILL) after `delay_s`."""
    engine_hang_steps: list[int] = field(default_factory=list)
    """Steps whose generation gets its engine's scheduler stopped (SIGSTOP) after `delay_s`."""
    engine_kill_in_load_steps: list[int] = field(default_factory=list)
    """For each step k, the first weight load to begin once step k's generation has started
    has its engine killed at once (the transfer dies half way)."""
    engine_kill_probability: float = 0.0
    """Chance, per step and engine, that the step's generation gets its engine killed."""
    delay_s: float = 0.5
    """Seconds after a step's generation starts that a kill or hang lands."""
    seed: int = 0
    """Seed of the random kills (each engine host draws its own stream)."""

    def __post_init__(self) -> None:
        if not isinstance(self.allow, bool):
            raise ConfigError("allow", self.allow, "must be true or false")
        for name in ("engine_kill_steps", "engine_hang_steps", "engine_kill_in_load_steps"):
            steps = getattr(self, name)
            if not isinstance(steps, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps
            ):
                raise ConfigError(name, steps, "must be a list of step numbers (ints >= 0)")
        require_number("engine_kill_probability", self.engine_kill_probability, ge=0, le=1)
        require_number("delay_s", self.delay_s, ge=0, unit="seconds")
        if self.any() and not self.allow:
            raise ConfigError(
                "allow", self.allow, "must be true for the faults this recipe asks to inject",
                "set faults.allow: true (fault injection is for tests and soak runs)",
            )  # fmt: skip

    def any(self) -> bool:
        return bool(self.engine_kill_steps or self.engine_hang_steps
                    or self.engine_kill_in_load_steps or self.engine_kill_probability)  # fmt: skip


class EngineFaults:
    """`hook(phase, step, engine)`: inject what `FaultsConfig` asks for at this point."""

    def __init__(self, cfg: FaultsConfig, rank: int, engine_index: int = 0, num_engines: int = 1):
        """With several engines, the faults of step k go to engine `k % num_engines` only
        (the others keep generating); random kills are drawn by every engine."""
        self.cfg, self.engine_index, self.num_engines = cfg, engine_index, num_engines
        self.rng = random.Random(f"{cfg.seed}:{rank}")
        self.done: set[tuple[str, int]] = set()
        self.counts: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, phase: str, step: int, engine) -> None:
        cfg = self.cfg
        if phase == "generate":
            mine = step % self.num_engines == self.engine_index
            self._maybe("kill", step, mine and step in cfg.engine_kill_steps, engine, cfg.delay_s)
            self._maybe("hang", step, mine and step in cfg.engine_hang_steps, engine, cfg.delay_s)
            if cfg.engine_kill_probability and (("random", step) not in self.done):
                self.done.add(("random", step))
                if self.rng.random() < cfg.engine_kill_probability:
                    self._maybe("kill", step, True, engine, cfg.delay_s)
        elif phase == "load":
            for due in cfg.engine_kill_in_load_steps:
                if due <= step and due % self.num_engines == self.engine_index:
                    self._maybe("kill_in_load", due, True, engine, 0.0)

    def take_metrics(self) -> dict[str, float]:
        with self._lock:
            out, self.counts = self.counts, {}
        return out

    def _maybe(self, kind: str, step: int, due: bool, engine, delay_s: float) -> None:
        with self._lock:
            if not due or (kind, step) in self.done:
                return
            self.done.add((kind, step))
            key = f"faults/injected/engine_{kind}"
            self.counts[key] = self.counts.get(key, 0.0) + 1
        sig = signal.SIGSTOP if kind == "hang" else signal.SIGKILL
        logger.warning("fault injection: %s of the engine's scheduler at step %d in %.1f s",
                       sig.name, step, delay_s)  # fmt: skip
        if delay_s:
            threading.Timer(delay_s, engine.signal_scheduler, (sig,)).start()
        else:
            engine.signal_scheduler(sig)
