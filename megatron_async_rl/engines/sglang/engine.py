"""The real SGLang engine behind the `Engine` protocol, hosted in its own process.

Owned here: `SGLangEngine` (what a `generate` rank calls, configured by
`engines.config.SGLangEngineConfig`) and the engine host that runs in a child process. The host
side lives in `host.py`, the only module of the package that imports `sglang` (inside the
host process only).

    generate rank (torchrun worker)                engine host (spawned child)
    SGLangEngine ---- pipe: ("call", id, method, kwargs) ---> asyncio loop: sglang.Engine
                 <--- ("ok"|"error", id, payload), ("died", cause)    tokenizer manager
                                                                       + scheduler, detokenizer

Why a dedicated host process (measured with sglang 0.5.21 on CPU). `sglang.Engine` switches
multiprocessing to spawn for its whole process, and its `shutdown()` kills every child of that
process. When a scheduler or detokenizer dies, SGLang's watchdog thread sends SIGQUIT to the
process that created the engine: created from the main thread, the handler kills the whole
process tree (the torchrun rank included, exit 137); created from a non-main thread, no handler
is installed and SIGQUIT's default action kills the process anyway (exit 131, ~1 s after the
scheduler was killed, nothing reported). In a host child all of this is contained: the host
replaces the SIGQUIT handler with one that reports which child died with what exit code, then
kills the engine's processes and exits; the rank sees the pipe close and raises
`EngineDiedError` naming role, rank in role, global rank and cause (~1.2 s after a scheduler is
SIGKILLed). If the rank itself dies, the host sees the pipe close and shuts the engine down
(~2.6 s). Costs, measured: the rank's RSS does not grow at all (the host, ~0.7 GiB, is the
tokenizer-manager process the rank would otherwise be) and a pipe round trip is ~0.2 ms.
Weights do not cross the host: the rank pickles the tensors of `update_weights` itself
(`handover.serialize`: shared-memory handles on CPU, CUDA IPC handles on GPU, one per call
for views of one buffer) and the host hands the bytes to SGLang's schedulers untouched.

Every call has a timeout (`SGLangEngineConfig.*_timeout_s`) and raises `EngineTimeoutError`
naming the call. On CPU the host sets `SGLANG_USE_CPU_ENGINE=1` before importing sglang and
puts `cpu_shims/` first on its `sys.path` and on `PYTHONPATH` for the engine's children (see
`cpu_shims/README.md`); nothing of this touches the calling process. It also names SGLang's
`torch_native` attention backend, whatever the CPU (`host.CPU_ATTENTION_BACKEND`: SGLang
would otherwise probe for AMX; DeepSeek's multi-latent attention runs on it with the shims'
patch; the shims register `batched_attention.py` under that name, one SDPA call per layer for
each group of equal-length requests, unless `engine.cpu_attention: per_request`);
`SGLangEngine.attention_backend` reports the one SGLang resolved. Private CPU tensors
sent to `update_weights` are moved to shared memory by torch's multiprocessing pickler.
`get_weights_by_name` returns the full HF-named parameter as float32, vocab rows padded
(to a multiple of 64, times the TP size under TP) for the embedding and LM head; SGLang 0.5.21
to 0.5.23 implement it for Llama-family models only. Under engine TP > 1, SGLang's own
`get_weights_by_name` answers from TP rank 0 alone (its shard of q/k/v, gate/up and the vocab
rows; o_proj/down_proj all-gathered), so the host instead has every TP rank dump its parameters
with SGLang's `save_sharded_model` (into a temporary directory, once per weight version) and
reassembles the HF tensor from the shards (`host.assemble_hf_tensor`), checking that
replicated parameters agree across ranks.

Engine TP on CPU: SGLang binds each TP rank's OpenMP threads to the cores named in
`SGLANG_CPU_OMP_THREADS_BIND` and without it allows one TP rank per NUMA node only. When it is
unset, the host sets it for its engine by splitting the cores this process may run on into
`tp_size` contiguous groups ("0|1" on 2 cores; `host.cpu_threads_bind`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor pickling for the pipe

from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.engines.protocol import (
    EngineDiedError,
    EngineTimeoutError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    WeightSessions,
    check_pause_mode,
)
from megatron_async_rl.engines.recovery.progress import PartialResults
from megatron_async_rl.engines.sglang import handover
from megatron_async_rl.engines.sglang.host import (  # noqa: F401 - CPU_SHIMS_DIR re-exported
    CPU_SHIMS_DIR,
    HOST_EXIT_CHILD_DIED,
    host_main,
    kill_tree,
    processes,
)
from megatron_async_rl.engines.sglang.shm_sweep import (
    load_snapshot_files,
    remove_files,
    remove_stale_segments,
)

logger = logging.getLogger(__name__)


class _Pending:
    """One call waiting for its reply."""

    def __init__(self):
        self.event = threading.Event()
        self.reply: tuple[str, Any] = ("died", None)

    def resolve(self, kind: str, payload: Any) -> None:
        self.reply = (kind, payload)
        self.event.set()


class HostLaunch:
    """An engine host process, spawned and starting its engine: not waited for here.

    `SGLangEngine` waits for it to serve. A launch made early (`roles.generate.EngineHeadStart`:
    the host imports SGLang and starts its engine while the rank builds its world and roles)
    that no `SGLangEngine` adopts is ended with `kill`."""

    def __init__(self, config: SGLangEngineConfig, *, rank_in_role: int = 0, global_rank: int = 0):
        self.config = config
        where = f"role generate, rank in role {rank_in_role}, global rank {global_rank}"
        stale = remove_stale_segments()
        if stale:
            logger.info("[%s] removed %d shared-memory segment(s) of dead engines from "
                        "/dev/shm: %s", where, len(stale), ", ".join(stale))  # fmt: skip
        ctx = mp.get_context("spawn")
        self.conn, host_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=host_main, args=(host_conn, config), name=f"sglang-host-{rank_in_role}"
        )
        self.started = time.monotonic()
        self.proc.start()
        host_conn.close()

    def kill(self) -> None:
        """End the host and the engine processes it started so far, and remove the
        load-snapshot file its scheduler made, if it got that far (read just before the kill)."""
        files = load_snapshot_files(self.proc.pid)
        kill_tree(self.proc.pid)
        self.proc.join(timeout=10)
        self.conn.close()
        remove_files(files)


class SGLangEngine:
    """`Engine` over a real `sglang.Engine` running in a dedicated host process."""

    def __init__(
        self, config: SGLangEngineConfig, *, rank_in_role: int = 0, global_rank: int = 0,
        launch: HostLaunch | None = None,
    ):  # fmt: skip
        """Start an engine with `config` and wait until it serves; with `launch` (an engine
        host spawned earlier with the same config), wait for that one instead."""
        self.config = config
        self.where = f"role generate, rank in role {rank_in_role}, global rank {global_rank}"
        self._pending: dict[int, _Pending] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._death: str | None = None
        self._death_notice: str | None = None
        self._closed = False
        self._pause_mode: str | None = None
        self.sessions = WeightSessions(self.where)
        self._partial = PartialResults()
        if launch is None:
            launch = HostLaunch(config, rank_in_role=rank_in_role, global_rank=global_rank)
        elif launch.config != config:
            raise ValueError(f"[{self.where}] a host launched for another engine config")
        self._conn, self._proc = launch.conn, launch.proc
        start = launch.started
        info = self._wait_ready(start)
        self.host_pid: int = self._proc.pid
        self.engine_child_pids: list[int] = info["child_pids"]
        self.max_input_tokens: int | None = info.get("max_input_tokens")
        """SGLang refuses a request whose input has this many tokens or more."""
        self.context_tokens: int | None = info.get("context_tokens")
        """SGLang refuses a request whose input plus max_new_tokens is longer."""
        self.attention_backend: str | None = info.get("attention_backend")
        """The attention backend SGLang resolved at launch (on CPU `torch_native`, whatever the
        CPU: `host.CPU_ATTENTION_BACKEND`)."""
        self.start_method: str | None = info.get("start_method")
        """How the host started SGLang's processes (`SGLangEngineConfig.start_method`)."""
        self._engine_procs = processes(self.engine_child_pids)
        self._engine_files: list[str] = info.get("files", [])
        self.startup_s = time.monotonic() - start
        self._reader = threading.Thread(target=self._read_replies, daemon=True)
        self._reader.start()
        atexit.register(self.shutdown)
        logger.info("[%s] SGLang engine up in %.1f s (attention backend %s)", self.where,
                    self.startup_s, self.attention_backend)  # fmt: skip

    # -- Engine protocol ---------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if not requests:
            return []
        self.sessions.check_whole()
        try:
            results = self._call("generate", self.config.generate_timeout_s,
                                 requests=list(requests))  # fmt: skip
            self._partial.forget(r.rid for r in requests)
            return results
        except EngineTimeoutError:
            for request in requests:  # best effort: do not leave them decoding
                self._send_only("abort", rid=request.rid)
            raise

    def partial_results(self, rids: Sequence[str]) -> dict[str, GenerateResult]:
        """The newest progress the host reported for `rids` (with
        `progress_every_tokens` > 0; `engines.recovery.progress`)."""
        return self._partial.take(rids)

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")
        self.sessions.begin()

    def update_weights(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        version: str | int,
        flush_cache: bool = True,
    ) -> None:
        if flush_cache and self._pause_mode == "in_place":
            raise ValueError(
                "update_weights(flush_cache=True) while paused in_place: the held requests keep "
                "their KV cache and SGLang's scheduler dies on a cache flush with requests "
                "running; pass flush_cache=False, or pause with mode='retract'"
            )
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        # Pickled here, where the memory lives (`handover`): the host passes the bytes on.
        payloads, load_format = handover.serialize(named, self.config.tp_size)
        self._call(
            "update_weights",
            payloads=payloads,
            load_format=load_format,
            version=str(version),
            flush_cache=flush_cache,
        )
        self.sessions.loaded()

    def end_weight_update(self, complete: bool = True) -> None:
        self._call("end_weight_update")
        self.sessions.end(complete)

    def weight_version(self) -> str:
        return self._call("weight_version")

    def pause(self, mode: PauseMode) -> None:
        check_pause_mode(mode)
        self._call("pause", mode=mode)
        self._pause_mode = mode

    def resume(self) -> None:
        self._call("resume")
        self._pause_mode = None

    def abort(self, rid: str | None = None) -> None:
        self._call("abort", rid=rid)

    def flush_cache(self) -> None:
        self._call("flush_cache")

    def health(self) -> bool:
        if self._death is not None or self._closed:
            return False
        try:
            return bool(self._call("health", min(self.config.call_timeout_s, 30.0)))
        except (EngineDiedError, EngineTimeoutError):
            return False

    def probe(self, timeout_s: float, control_only: bool = False) -> str | None:
        """None if the engine answers a one-token greedy request within `timeout_s` (with
        `control_only`, for a paused engine or one loading weights: a round trip to its
        schedulers), else what went wrong. The health check of `engines.recovery.restarting`: a hung
        scheduler still looks alive to `health`."""
        if self._death is not None or self._closed:
            return self._death or "shut down"
        if control_only:
            what, method, kwargs = "a scheduler round trip", "ping", {}
        else:
            rid = f"health-probe-{next(self._call_ids)}"
            sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
            what, method = "a one-token request", "generate"
            kwargs = {"requests": [GenerateRequest([1], sampling, rid)]}
        try:
            self._call(method, timeout_s, **kwargs)
        except EngineTimeoutError:
            if not control_only:
                self._send_only("abort", rid=rid)
            return f"no answer to {what} within {timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            return f"{type(exc).__name__}: {exc}"
        return None

    def signal_scheduler(self, sig: int) -> None:
        """Send `sig` to the engine's scheduler process(es) (fault injection: SIGKILL is a
        crash, SIGSTOP a hang)."""
        for proc in self._engine_procs:
            with contextlib.suppress(Exception):
                if "scheduler" in proc.name():
                    proc.send_signal(sig)

    def kill(self, cause: str) -> None:
        """Kill the engine's processes at once (a hung engine does not answer `shutdown`);
        calls waiting on it raise `EngineDiedError` naming `cause`."""
        self._death_notice = f"killed by the rank: {cause}"
        kill_tree(self._proc.pid, also=self._engine_procs)

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """The full HF-named tensor as served, float32, vocab rows padded (module docstring)."""
        return self._call("get_weights_by_name", name=name)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._death is None and self._death_notice is None and self._proc.is_alive():
            try:
                self._call("shutdown", check_closed=False)
            except (EngineDiedError, EngineTimeoutError) as exc:
                logger.warning("[%s] engine shutdown: %s", self.where, exc)
        self._proc.join(timeout=30)
        # Whatever is left, e.g. after a timed-out shutdown or a host that was killed.
        kill_tree(self._proc.pid, also=self._engine_procs)
        self._proc.join(timeout=10)
        remove_files(self._engine_files)  # what SGLang left in /dev/shm (the host has exited)
        self._conn.close()


    # -- RPC plumbing -------------------------------------------------------------------------

    def _wait_ready(self, start: float) -> dict:
        deadline = start + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            try:
                message = self._conn.recv() if self._conn.poll(0.2) else None
            except (EOFError, OSError):  # the host died before it said anything
                message = None
                self._proc.join(timeout=30)
            if message is not None and message[0] == "ready":
                return message[1]
            if message is not None:
                self._proc.join(timeout=30)
                raise EngineDiedError(
                    f"SGLang engine failed to start ({self.where}); host exit code "
                    f"{self._proc.exitcode}; the engine raised:\n{message[1]}"
                )
            if not self._proc.is_alive():
                raise EngineDiedError(
                    f"SGLang engine host exited during startup ({self.where}) with exit code "
                    f"{self._proc.exitcode}; see the engine's log above"
                )
        kill_tree(self._proc.pid)
        raise EngineTimeoutError(
            f"SGLang engine did not start within startup_timeout_s="
            f"{self.config.startup_timeout_s} s ({self.where}); host killed"
        )

    def _read_replies(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "died":
                self._death_notice = message[1]
                continue
            if message[0] == "progress":
                self._partial.update(message[1])
                continue
            kind, call_id, payload = message
            pending = self._pending.pop(call_id, None)
            if pending is not None:
                pending.resolve(kind, payload)
        self._proc.join(timeout=10)
        kill_tree(None, also=self._engine_procs)  # orphans, if the host was killed outright
        remove_files(self._engine_files)  # what SGLang left in /dev/shm (the host has exited)
        if not self._closed:
            cause = self._death_notice or "the engine host process exited"
            self._death = f"{cause}; host pid {self._proc.pid} exit code {self._proc.exitcode}"
            logger.error("[%s] SGLang engine died: %s", self.where, self._death)
        for pending in list(self._pending.values()):
            pending.resolve("died", None)

    def _send_only(self, method: str, **kwargs) -> int:
        call_id = next(self._call_ids)
        try:
            with self._send_lock:
                self._conn.send(("call", call_id, method, kwargs))
        except (OSError, ValueError):
            pass  # the reader reports the death
        return call_id

    def _call(self, method: str, timeout_s: float | None = None, *, check_closed=True, **kwargs):
        if check_closed and self._closed:
            raise RuntimeError(f"SGLang engine ({self.where}) was shut down; cannot call {method}")
        if self._death is not None:
            raise EngineDiedError(
                f"SGLang engine died ({self.where}): {self._death}; cannot call {method}"
            )
        timeout_s = self.config.call_timeout_s if timeout_s is None else timeout_s
        pending = _Pending()
        call_id = next(self._call_ids)
        self._pending[call_id] = pending
        try:
            with self._send_lock:
                self._conn.send(("call", call_id, method, kwargs))
        except (OSError, ValueError):
            pending.resolve("died", None)
        if not pending.event.wait(timeout_s):
            self._pending.pop(call_id, None)
            raise EngineTimeoutError(
                f"SGLang engine ({self.where}) did not answer {method} within {timeout_s} s "
                f"(host pid {self._proc.pid} alive: {self._proc.is_alive()})"
            )
        kind, payload = pending.reply
        if kind == "ok":
            return payload
        if kind == "error":
            raise payload
        if self._closed and method != "shutdown" and self._death_notice is None:
            raise RuntimeError(f"SGLang engine ({self.where}) was shut down during {method}")
        self._reader.join(timeout=15)  # lets the reader record the cause
        raise EngineDiedError(
            f"SGLang engine died ({self.where}) while waiting for {method}: "
            f"{self._death or 'the engine host process exited'}"
        )
