"""An engine that survives its own death: restart in place, current weights, calls carried on.

Owned here: `RestartingEngine`, the `Engine` a generate rank drives (`roles.generate`). It wraps
one real engine (`start()` makes it) and keeps, in host memory, the newest *complete* weight
version it has loaded (HF name -> tensor, copied from every `update_weights` call and promoted
when the session ends complete). When a call finds the engine dead (`EngineDiedError`), or it
does not answer (`EngineTimeoutError`), or the watchdog finds it hung, it:

1. kills what is left of the engine's processes (`kill`) and charges the restart budget
   (`engine.max_restarts` per `engine.restart_window_steps`; past it the run stops with
   `EngineRestartLimitError` naming the engine, the rank, every cause and the counts);
2. starts a new engine, which is STALE (it serves the model on disk) until
3. the newest complete version is loaded into it, stamped with that version's label;
4. restores what the caller was in the middle of: a paused engine is paused again, an open
   weight-update session is opened again and the tensors already loaded in it are loaded again,
   so a transfer that died half way simply goes on;
5. carries on the call that failed. Every thread blocked in a call on the dead engine does the
   same once the restart is done (one restart per death: the first caller restarts, the others
   see a newer engine and retry on it). A `generate` call goes on from where the dead engine
   was: the requests it had finished are kept whole, the others continue from the tokens it
   had reported (`Engine.partial_results`; the SGLang engine host reports every
   `engine.progress_every_tokens` tokens), each token keeping its log-prob and weight version
   (`engines.recovery.prefixes`: a prefix older than the step's staleness window, `set_step`'s
   `oldest_version`, is generated again). Counted: `engines/requests_resubmitted` (requests
   sent again), `engines/tokens_kept`, `engines/tokens_regenerated` (reported tokens thrown
   away as too stale; tokens decoded after the engine's last report are not known, so not
   counted).

With several engines (`board`, `engines.recovery.reassign.HelpBoard`), the requests a dead
engine still owes are posted for the others before it restarts: another engine host's helper
thread takes them over when its engine serves a version inside their step's window, and the
dead engine's host, once its engine is back, takes back what nobody claimed or waits for the
helper's results (`engines/requests_reassigned`; the helper counts `engines/requests_taken_over`).

The watchdog (a thread, every `engine.health_check_every_s`) asks the engine for one token
within `engine.health_timeout_s / 2` (while it is paused or loading weights, when it answers
no generate request, for a round trip to its schedulers): one failure makes it SUSPECT, a
second DEAD (it is killed, and the calls blocked on it restart it). A hung engine (SIGSTOP, a
deadlock) is so found within about `health_check_every_s + health_timeout_s`.

Metrics (`take_metrics`, summed over engines): `engines/healthy`, `engines/restarts`,
`engines/restart_s` split into `engines/restart_start_s` (new process) and
`engines/restart_load_s` (weights), `engines/restart_resubmit_s` (the carried-on generate
calls: the resubmitted requests generated from their prefixes), `engines/requests_resubmitted`,
`engines/tokens_kept`, `engines/tokens_regenerated`, `engines/requests_reassigned`,
`engines/requests_taken_over`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from megatron_async_rl.engines.protocol import (
    INITIAL_VERSION,
    EngineDiedError,
    EngineTimeoutError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    RestartableEngine,
    version_number,
)
from megatron_async_rl.engines.recovery import prefixes
from megatron_async_rl.engines.recovery.health import (
    EngineHealth,
    EngineRestartLimitError,
    RestartBudget,
    transition,
)
from megatron_async_rl.engines.recovery.reassign import HelpBoard

logger = logging.getLogger(__name__)

_FAILURES = (EngineDiedError, EngineTimeoutError)


class RestartingEngine:
    """`Engine` over a replaceable inner engine (module docstring); what it adds is the
    `ManagedEngine` protocol (`engines.protocol`), what it needs of the inner engine
    `RestartableEngine`."""

    def __init__(self, start: Callable[[], RestartableEngine], reload: Callable, *, where: str,
                 max_restarts: int, window_steps: int, health_timeout_s: float,
                 check_every_s: float, faults=None, board: HelpBoard | None = None,
                 help_every_s: float = 0.5, generate_timeout_s: float = 3600.0):  # fmt: skip
        """`start()` makes an engine; `reload(engine, tensors, label)` loads a version into
        one (`weight_sync.sinks.load_tensors`: in chunks, through shared memory); `faults`, an
        `engines.recovery.faults.EngineFaults`, injects the recipe's faults (tests, soak runs);
        `board` (with several engines) hands a dead engine's requests to the others and
        takes theirs, polled every `help_every_s`."""
        self.board, self.help_every_s = board, help_every_s
        self.help_gate: Callable = contextlib.nullcontext
        """Entered around a job taken over from another engine: the asynchronous loop sets
        its engine gate's `generating(stage=False)`."""
        self.generate_timeout_s = generate_timeout_s
        self._start, self._reload, self.where = start, reload, where
        self._faults = faults
        self.inner = start()
        self.state = EngineHealth.HEALTHY
        self.budget = RestartBudget(where, max_restarts, window_steps)
        self.keeps_weights = max_restarts > 0
        self.health_timeout_s, self.check_every_s = health_timeout_s, check_every_s
        self.step = 0
        self.oldest_version: int | None = None
        self._lock = threading.RLock()
        self._epoch = 0  # +1 per restart: a caller that failed on an older engine only retries
        self._last: dict[str, torch.Tensor] = {}  # newest complete version, host copies
        self._last_label: str | None = None
        self._session: dict[str, torch.Tensor] | None = None  # loaded in the open session
        self._session_label: str | None = None
        self._paused: str | None = None
        self._closed = threading.Event()
        self._metrics = dict.fromkeys(
            ("engines/restarts", "engines/restart_s", "engines/restart_start_s",
             "engines/restart_load_s", "engines/restart_resubmit_s",
             "engines/requests_resubmitted", "engines/tokens_kept", "engines/tokens_regenerated",
             "engines/requests_reassigned", "engines/requests_taken_over"),
            0.0,
        )  # fmt: skip
        self._helper = None
        if board is not None and self.keeps_weights:
            self._helper = threading.Thread(target=self._help, daemon=True, name="engine-help")
            self._helper.start()
        self._watchdog = None
        if self.keeps_weights and check_every_s > 0:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name="engine-watchdog")  # fmt: skip
            self._watchdog.start()

    # -- what the generate side tells and asks ---------------------------------------------

    def set_step(self, step: int, oldest_version: int | None = None) -> None:
        """The step being generated (the restart budget's window counts steps), and the
        oldest policy version its tokens may carry (a cut request's prefix with older tokens
        is generated again; None: every prefix is kept)."""
        self.step, self.oldest_version = step, oldest_version

    def resumed_at(self, step: int) -> None:
        """The run resumed at `step`: faults due before it were injected by an earlier
        attempt (`EngineFaults.skip_before`)."""
        self.step = step
        if self._faults is not None:
            self._faults.skip_before(step)

    def take_metrics(self) -> dict[str, float]:
        """Counters since the last call, and whether the engine is healthy now."""
        with self._lock:
            out = {k: v for k, v in self._metrics.items() if v}
            self._metrics = dict.fromkeys(self._metrics, 0.0)
            out["engines/healthy"] = float(self.state == EngineHealth.HEALTHY)
        if self._faults is not None:
            out.update(self._faults.take_metrics())
        return out

    # -- Engine protocol -------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        kept: dict[str, GenerateResult] = {}  # rid -> what dead engines had generated
        jobs: list[int] = []  # posted on the help board while this engine restarted
        retries = []  # one entry per failed call: the next is a carried-on one

        def call(engine):
            self._inject("generate", engine)
            todo = [prefixes.continuation(r, kept.get(r.rid)) for r in requests]
            todo = [r for r in todo if r is not None]
            start = time.monotonic()
            rest = {}
            while jobs:  # another engine may have taken them over meanwhile
                helped = self._collect(jobs.pop())
                rest.update({r.rid: r for r in helped})
            todo = [r for r in todo if r.rid not in rest]
            rest.update({r.rid: r for r in engine.generate(todo)} if todo else {})
            if retries:  # a carried-on call: the resubmitted requests' share of the recovery
                self._metrics["engines/restart_resubmit_s"] += time.monotonic() - start
            return [prefixes.joined(kept.get(r.rid), rest.get(r.rid)) for r in requests]

        def on_retry(failed):
            retries.append(failed)
            partial = failed.partial_results([r.rid for r in requests])
            m = self._metrics
            for request in requests:
                before = kept.get(request.rid)
                if before is not None and prefixes.is_finished(before):
                    continue
                new, dropped = prefixes.kept_prefix(partial.get(request.rid), self.oldest_version)
                if new is not None:
                    kept[request.rid] = prefixes.settled(request, prefixes.joined(before, new))
                m["engines/tokens_kept"] += len(new.output_ids) if new is not None else 0
                m["engines/tokens_regenerated"] += dropped
                finished = request.rid in kept and prefixes.is_finished(kept[request.rid])
                m["engines/requests_resubmitted"] += not finished
            if self.board is not None:  # the other engines may take them while this restarts
                todo = [prefixes.continuation(r, kept.get(r.rid)) for r in requests]
                todo = [r for r in todo if r is not None]
                if todo:
                    jobs.append(self.board.post(todo, self.oldest_version))

        return self._carry_on("generate", call, on_retry)

    def _collect(self, job: int) -> list[GenerateResult]:
        """A posted job's results: none when this engine takes it back (nobody claimed it),
        else the helper's."""
        if self.board.take_back(job):
            return []
        helper = self.board.owner(job)
        results = self.board.wait(job, self.generate_timeout_s)
        if isinstance(results, BaseException):
            raise RuntimeError(
                f"[{self.where}] engine host {helper}, which took over requests of this "
                f"engine, failed: {results}"
            ) from results
        self._metrics["engines/requests_reassigned"] += len(results)
        return results

    def _help(self) -> None:
        """Helper thread: generate jobs other engine hosts posted while theirs restart, as a
        batch of this engine's own users (`help_gate`: not during its own generation, a
        validation or a load that must land between batches; an in-flight load pauses it)."""
        while not self._closed.wait(self.help_every_s):
            if self.state != EngineHealth.HEALTHY:
                continue
            version = version_number(self._last_label or INITIAL_VERSION)
            try:
                if self.board.claim_next(version, claim=False) is None:
                    continue
                with self.help_gate():  # claimed only once this engine is free for it
                    claimed = self.board.claim_next(version)
                    if claimed is not None:
                        self._take_over(*claimed)
            except Exception as exc:  # noqa: BLE001 - the store is gone: the run is ending
                logger.warning("[%s] help board: %r", self.where, exc)
                return

    def _take_over(self, job: int, todo: list[GenerateRequest]) -> None:
        logger.warning("[%s] taking over %d request(s) of another engine (job %d)",
                       self.where, len(todo), job)  # fmt: skip
        try:
            results = self.generate(todo)
            self._metrics["engines/requests_taken_over"] += len(todo)
        except Exception as exc:  # noqa: BLE001 - the poster raises it
            results = RuntimeError(f"{type(exc).__name__}: {exc}")
        self.board.deliver(job, results)

    def begin_weight_update(self) -> None:
        def call(engine):
            engine.begin_weight_update()
            self._inject("load", engine)

        self._carry_on("begin_weight_update", call)
        self._session, self._session_label = {}, None

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: str | int,
                       flush_cache: bool = True) -> None:  # fmt: skip
        self._carry_on(
            "update_weights", lambda e: e.update_weights(named_tensors, version, flush_cache)
        )
        self._session_label = str(version)
        if self.keeps_weights and self._session is not None:
            for name, tensor in named_tensors:
                self._session[name] = tensor.detach().to("cpu", copy=True)

    def end_weight_update(self, complete: bool = True) -> None:
        self._carry_on("end_weight_update", lambda e: e.end_weight_update(complete))
        with self._lock:
            if complete and self._session is not None and self._session_label is not None:
                self._last.update(self._session)
                self._last_label = self._session_label
            self._session = self._session_label = None

    def weight_version(self) -> str:
        return self._carry_on("weight_version", lambda e: e.weight_version())

    def pause(self, mode: PauseMode) -> None:
        self._carry_on("pause", lambda e: e.pause(mode))
        self._paused = mode

    def resume(self) -> None:
        self._carry_on("resume", lambda e: e.resume())
        self._paused = None

    def abort(self, rid: str | None = None) -> None:
        self._carry_on("abort", lambda e: e.abort(rid))

    def flush_cache(self) -> None:
        self._carry_on("flush_cache", lambda e: e.flush_cache())

    def health(self) -> bool:
        return self.state == EngineHealth.HEALTHY and self.inner.health()

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        return self._carry_on("get_weights_by_name", lambda e: e.get_weights_by_name(name))

    def shutdown(self) -> None:
        self._closed.set()
        self.inner.shutdown()

    def restore_last_version(self) -> None:
        """A version failed on every attempt (`weight_sync.on_failure: keep_serving`): the
        engine serves the newest complete version again, reloaded into it; with none kept yet
        (the checkpoint's weights), it is restarted, and the new process loads those."""
        with self._lock:
            self._session = self._session_label = None
            epoch = self._epoch
            if self._last:
                start = time.monotonic()
                self._reload(self.inner, self._last, self._last_label)
                logger.warning("[%s] weights %s reloaded in %.1f s after a failed version",
                               self.where, self._last_label, time.monotonic() - start)  # fmt: skip
                return
        self._restart(epoch, "a weight version failed on every attempt (no copy kept yet)")

    def _inject(self, phase: str, engine) -> None:
        if self._faults is not None:
            self._faults(phase, self.step, engine)

    # -- restart ---------------------------------------------------------------------------

    def _carry_on(self, method: str, call, on_retry=None):
        while True:
            with self._lock:  # waits for a restart in progress
                epoch, engine = self._epoch, self.inner
            try:
                return call(engine)
            except Exception as exc:
                with self._lock:
                    replaced = epoch != self._epoch
                # Whatever the old engine said once it was being replaced, the call goes on.
                if not replaced:
                    if not (isinstance(exc, _FAILURES) and self.keeps_weights):
                        raise
                    if self._closed.is_set():  # shut down on purpose: nothing to restart
                        raise
                if on_retry is not None:  # before the restart: what the dead engine had
                    on_retry(engine)
                if not replaced:
                    self._restart(epoch, f"{method}: {exc}")
                logger.warning("[%s] %s carried on by the restarted engine", self.where, method)

    def _restart(self, epoch: int, cause: str) -> None:
        with self._lock:
            if epoch != self._epoch:
                return  # another caller restarted it already
            if self.state != EngineHealth.DEAD:
                self.state = transition(self.where, self.state, EngineHealth.DEAD, cause)
            logger.error("[%s] engine failed at step %d: %s", self.where, self.step, cause)
            _kill(self.inner, cause)
            self.budget.charge(self.step, cause)  # raises past the limit: the run stops
            self.state = transition(self.where, self.state, EngineHealth.RESTARTING, "restart")
            start = time.monotonic()
            try:
                self.inner = self._start()
            except _FAILURES as exc:
                self.state = transition(self.where, self.state, EngineHealth.DEAD, str(exc))
                raise EngineRestartLimitError(
                    f"engine [{self.where}]: the restart after '{cause}' failed: {exc}"
                ) from exc
            started = time.monotonic()
            self._epoch += 1
            self.state = transition(self.where, self.state, EngineHealth.STALE, "new process")
            self._restore()
            self.state = transition(self.where, self.state, EngineHealth.HEALTHY, "weights in")
            done = time.monotonic()
            m = self._metrics
            m["engines/restarts"] += 1
            m["engines/restart_start_s"] += started - start
            m["engines/restart_load_s"] += done - started
            m["engines/restart_s"] += done - start
            logger.warning(
                "[%s] engine restarted in %.1f s (process %.1f s, weights %s %.1f s); "
                "%d restart(s) so far", self.where, done - start, started - start,
                self._last_label or "from disk", done - started, len(self.budget.causes),
            )  # fmt: skip

    def _restore(self) -> None:
        """The new engine as the dead one was: newest complete weights, then the caller's
        pause and open session (with what it had loaded)."""
        if self._last:
            self._reload(self.inner, self._last, self._last_label)
        if self._paused is not None:
            self.inner.pause(self._paused)
        if self._session is not None:
            self.inner.begin_weight_update()
            if self._session:
                # The label the session's last load carried: the new version's once its final
                # call went through (found by the soak: a death in end_weight_update restored
                # the new weights under the old label, and their tokens broke the lag bound).
                label = self._session_label or self._last_label or self.inner.weight_version()
                self.inner.update_weights(list(self._session.items()), label, flush_cache=False)

    # -- watchdog --------------------------------------------------------------------------

    def _watch(self) -> None:
        failures = 0
        while not self._closed.wait(self.check_every_s):
            with self._lock:
                busy = self._paused is not None or self._session is not None
                engine, epoch = self.inner, self._epoch
            if self.state not in (EngineHealth.HEALTHY, EngineHealth.SUSPECT):
                continue
            # A paused engine, or one loading weights, answers no generate request: ask its
            # schedulers for a round trip instead (a hang in a load is found the same).
            problem = engine.probe(self.health_timeout_s / 2, control_only=busy)
            with self._lock:
                if epoch != self._epoch or self._closed.is_set():
                    failures = 0
                    continue
                if problem is None:
                    failures = 0
                    if self.state == EngineHealth.SUSPECT:
                        self.state = transition(self.where, self.state, EngineHealth.HEALTHY,
                                                "probe answered")  # fmt: skip
                    continue
                failures += 1
                new = EngineHealth.SUSPECT if failures == 1 else EngineHealth.DEAD
                self.state = transition(self.where, self.state, new, problem)
                logger.warning("[%s] health check failed (%s): %s", self.where, new.value, problem)
                if new == EngineHealth.DEAD:
                    # Calls blocked on it fail now (EngineDiedError) and restart it; with none,
                    # the next call does.
                    engine.kill(f"health check: {problem}")
                    failures = 0


def _kill(engine, cause: str) -> None:
    engine.kill(cause)
    try:
        engine.shutdown()
    except Exception as exc:  # noqa: BLE001 - it is dead already; say so and go on
        logger.warning("shutting down the dead engine: %r", exc)
