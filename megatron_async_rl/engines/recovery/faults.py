"""Faults injected on purpose into the engines, to prove recovery (tests and soak scripts).

Owned here: `EngineFaults`, which injects what the recipe's `faults:` section asks for
(`engines.config.FaultsConfig`: off by default, refused unless `faults.allow: true`), the
hook `engines.recovery.restarting.RestartingEngine` calls when a step's generation starts and when a
weight load begins. It signals the engine's
scheduler process as a real fault would: SIGKILL (a crash) or SIGSTOP (a hang), during
generation after `delay_s`, or right after a weight load began (a transfer that dies half way).
Each fault is injected once per (kind, step), also when the step's generation is carried on
by a restarted engine; with several engines, into engine `step % num_engines` only. Counted
as `faults/injected/engine_kill`, `.../engine_hang`, `.../engine_kill_in_load`. Pure of torch
and sglang.
"""

from __future__ import annotations

import logging
import random
import signal
import threading

from megatron_async_rl.engines.config import FaultsConfig

logger = logging.getLogger(__name__)


class EngineFaults:
    """`hook(phase, step, engine)`: inject what `FaultsConfig` asks for at this point."""

    def __init__(self, cfg: FaultsConfig, rank: int, engine_index: int = 0, num_engines: int = 1):
        """With several engines, the faults of step k go to engine `k % num_engines` only
        (the others keep generating); random kills are drawn by every engine."""
        self.cfg, self.engine_index, self.num_engines = cfg, engine_index, num_engines
        self.rng = random.Random(f"{cfg.seed}:{rank}")
        self.done: set[tuple[str, int]] = set()
        self.start = 0
        """The step the run (re)started at: a kill in load due before it is not injected
        again after a resume (`skip_before`)."""
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
                if self.start <= due <= step and due % self.num_engines == self.engine_index:
                    self._maybe("kill_in_load", due, True, engine, 0.0)

    def skip_before(self, start: int) -> None:
        """The run resumed at step `start`: faults of earlier steps were injected already."""
        self.start = start

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
