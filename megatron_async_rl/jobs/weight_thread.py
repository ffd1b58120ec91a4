"""An engine host's weight thread in the asynchronous loop: the generate side's `param_update`.

Owned here: `EngineGate` (who may use the engine when: generation, validation, weight loads,
cache flushes) and `WeightReceiver` (receives every version through the exchange while the
engine keeps generating, then loads it; gates loads on validation in mode `exact`).

The rules, each a lock or a flag of `EngineGate`:
- `engine_lock` is held while the engine generates or validates. Mode `wait` loads under it too,
  so a load lands between two batches.
- `load_lock` is held by every load, and by whatever must not overlap one: the cache flush, a
  validation pass, and the generate stage's entry and exit. Mode `in_flight` loads without
  `engine_lock`: if a batch is generating, the load pauses it (the generate machine goes
  RUNNING -> PAUSED -> RUNNING). Pause `retract` flushes the prefix cache with the load; pause
  `in_place` leaves KV of older weights in it, flushed before the next batch, under `load_lock`,
  when no request can be in flight (SGLang refuses a flush with requests running).
- The generate stage leaves through `load_lock`, so a pause it is in always ends before its
  machine moves on.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext

from megatron_async_rl.distributed.collective_errors import name_failure
from megatron_async_rl.scheduler.states import StageState, StageTimeout
from megatron_async_rl.weight_sync.sinks import load_into_engine

S = StageState


class EngineGate:
    """The engine's users on one host, and the cache state loads leave behind."""

    def __init__(self, engine, generate_machine, in_flight: bool, pause: str = "retract"):
        self.engine, self.generate_machine, self.in_flight = engine, generate_machine, in_flight
        self.pause = pause
        """How an in-flight load pauses a generating batch (`SchedulerConfig.in_flight_pause`)."""
        self.engine_lock = threading.Lock()
        self.load_lock = threading.Lock()
        self._generating = self._stage_generating = False
        self._needs_flush = False

    def _flush_if_stale(self) -> None:
        """Under `load_lock` with the engine idle: drop KV computed with older weights."""
        if self._needs_flush:
            self.engine.flush_cache()
            self._needs_flush = False

    @contextmanager
    def generating(self, stage: bool = True):
        """Around a batch of the generate stage (`stage=False`: a batch of requests taken
        over from another engine, `engines.recovery.restarting`; loads treat it alike, but the
        generate stage's machine is not this batch's)."""
        with self.engine_lock:
            with self.load_lock:
                self._flush_if_stale()
                self._generating, self._stage_generating = True, stage
            try:
                yield
            finally:
                with self.load_lock:  # waits for a load that paused this batch to finish
                    self._generating = False

    @contextmanager
    def validating(self):
        """Around a validation pass: no load lands during it."""
        with self.engine_lock, self.load_lock:
            self._flush_if_stale()
            yield

    def load(self, tensors, version: int, started) -> float:
        """Load `version` into the engine under the rules above; `started()` is called once the
        engine is ours. Returns the seconds the engine could not generate."""
        with self.engine_lock if not self.in_flight else nullcontext(), self.load_lock:
            started()
            start = time.perf_counter()
            paused = self._generating
            machine = paused and self._stage_generating
            if machine:
                self.generate_machine.transition(S.PAUSED, f"in-flight load of v{version}")
            try:
                load_into_engine(self.engine, tensors, version, self.pause if paused else None)
            finally:
                if machine:
                    self.generate_machine.transition(S.RUNNING, f"v{version} loaded")
            self._needs_flush |= paused and self.pause == "in_place"
            return time.perf_counter() - start


class WeightReceiver(threading.Thread):
    """Receives versions loaded+1..num_versions and loads each into the engine (the `param_update`
    machine of an engine host; its spans are `load_weights` in traces)."""

    def __init__(self, exchange, gate: EngineGate, machine, sched, num_versions: int,
                 has_validator: bool, rank: int, wake, loaded: int = 0,
                 validated: int = -1):  # fmt: skip
        super().__init__(name="weight-receiver", daemon=True)
        self.exchange, self.gate, self.machine, self.sched = exchange, gate, machine, sched
        self.num_versions, self.rank, self.wake = num_versions, rank, wake
        self.cond = threading.Condition()
        self.loaded = loaded
        """The newest version the engine serves (a resumed run starts at the checkpoint's)."""
        self.validated = validated
        """The newest due version evaluated."""
        self.validation_open = has_validator
        self.stats = dict.fromkeys(("weight_sync/stall_s", "timing/weight_sync/receive_s"), 0.0)
        """Since `take_stats`: seconds the engine could not generate because of a load (paused
        in place, or held idle), and seconds spent receiving (it kept generating)."""
        self.error: BaseException | None = None

    # -- read by the scheduler's guards (any thread) -----------------------------------------
    def pending_validation(self) -> int | None:
        """The due version to evaluate now with the loaded weights, if any."""
        with self.cond:
            if not self.validation_open:
                return None
            if self.sched.validation_version == "exact":
                due = self.sched.validation_due(self.loaded) and self.loaded > self.validated
                return self.loaded if due else None
            every = self.sched.validation_every
            newest_due = self.loaded - self.loaded % every
            return newest_due if newest_due > self.validated else None

    def mark_validated(self, version: int) -> None:
        with self.cond:
            self.validated = max(self.validated, version)
            self.cond.notify_all()

    def close_validation(self) -> None:
        with self.cond:
            self.validation_open = False
            self.cond.notify_all()

    def take_stats(self) -> dict[str, float]:
        with self.cond:
            stats, self.stats = self.stats, dict.fromkeys(self.stats, 0.0)
        return stats

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"role generate, rank {self.rank}: the weight thread failed: {self.error}"
            ) from self.error

    def wait_validated(self, version: int, before: str = "") -> None:
        """Wait until due `version` (or a newer one, mode latest) was evaluated, or validation
        closed. Raises StageTimeout after `stage_timeout_s`, or the weight thread's error."""
        timeout = self.sched.stage_timeout_s
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.validation_open and self.validated < version and self.error is None:
                if not self.cond.wait(max(deadline - time.monotonic(), 0.0)):
                    raise StageTimeout(
                        f"validation of v{version}{before}", timeout, timeout,
                        {"role": "generate", "rank": self.rank, **self.machine.context()},
                    )  # fmt: skip
        self.check()

    # -- the thread ----------------------------------------------------------------------------
    def _wait_for_validation(self, version: int) -> None:
        """Mode exact: version - 1, if due, is evaluated before `version` replaces it."""
        previous = version - 1
        if self.sched.validation_version == "exact" and self.sched.validation_due(previous):
            self.wait_validated(previous, f" before loading v{version}")

    def run(self) -> None:
        machine = self.machine
        try:
            for version in range(self.loaded + 1, self.num_versions + 1):
                step = version - 1
                machine.transition(S.WAITING_INPUT, f"receiving v{version}", step=step)
                received = time.perf_counter()
                tensors, metrics = self.exchange.receive_weights(version)
                received = time.perf_counter() - received  # generation kept running
                if tensors is None and metrics.get("weight_sync/failed_versions"):
                    # Failed on every attempt (weight_sync.on_failure: keep_serving): nothing
                    # of it was staged; the engine keeps serving the last version it loaded.
                    machine.transition(S.RUNNING, f"v{version} failed: v{self.loaded} kept")
                    machine.transition(S.IDLE, f"v{version} skipped")
                    continue  # counted by the train side (weight_sync/failed_versions)
                machine.transition(S.WAITING_OUTPUT_SPACE, f"engine ready for v{version}")
                self._wait_for_validation(version)
                started = f"loading v{version}"
                stall = self.gate.load(
                    tensors, version, lambda why=started: machine.transition(S.RUNNING, why)
                )
                machine.transition(S.IDLE, f"v{version} loaded")
                with self.cond:
                    self.loaded = version
                    self.stats["weight_sync/stall_s"] += stall
                    self.stats["timing/weight_sync/receive_s"] += received
                    self.cond.notify_all()
                self.wake()
            machine.transition(S.DONE, "every version loaded")
        except BaseException as err:  # noqa: BLE001 - surfaced by the scheduler's checks
            with self.cond:
                self.error = name_failure(err, {"stage": "param_update (weight thread)"})
                self.cond.notify_all()
            if not machine.is_terminal:
                machine.fail(err)
            self.wake()
