"""The SGLang engine host: what runs inside the child process a generate rank spawns.

Owned here: starting `sglang.Engine` in that child (after dropping the launcher's environment
and, on CPU, putting the import shims first), serving the rank's calls on the engine's event
loop, reporting which engine process died, and the process-tree helpers both sides use. This is
the only module of the package that imports `sglang`, and only inside `host_main`. The rank side
(`SGLangEngine`, the pipe protocol, timeouts) is `engines/sglang_engine.py`; read its docstring
for why the engine lives in a child process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor pickling for the pipe

from megatron_async_rl.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    expand_version_spans,
)

if TYPE_CHECKING:
    from megatron_async_rl.engines.sglang_engine import SGLangEngineConfig

logger = logging.getLogger(__name__)
CPU_SHIMS_DIR = Path(__file__).resolve().parent / "cpu_shims"
HOST_EXIT_CHILD_DIED = 3

# Set by torchrun for its workers. SGLang's schedulers start their own torch.distributed world;
# with TORCHELASTIC_USE_AGENT_STORE inherited, torch's tcp:// rendezvous joins as a client
# instead of creating its store and waits forever ("Init parallel begin", measured).
_LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def _scrub_launcher_env() -> None:
    for key in list(os.environ):
        if key in _LAUNCHER_ENV or key.startswith("TORCHELASTIC_"):
            del os.environ[key]


def host_main(conn, config: SGLangEngineConfig) -> None:
    """Entry point of the engine host: start `sglang.Engine`, then serve calls until shutdown."""
    _scrub_launcher_env()
    if config.device == "cpu":
        shims = str(CPU_SHIMS_DIR)
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (shims, os.environ.get("PYTHONPATH")) if p
        )
        sys.path.insert(0, shims)  # spawn copied the parent's sys.path over PYTHONPATH
    optional = {
        "max_total_tokens": config.max_total_tokens,
        "mem_fraction_static": config.mem_fraction_static,
    }
    try:
        import sglang

        engine = sglang.Engine(
            model_path=config.model_path,
            device=config.device,
            tp_size=config.tp_size,
            dtype=config.dtype,
            random_seed=config.random_seed,
            log_level=config.log_level,
            **{k: v for k, v in optional.items() if v is not None},
            **config.server_args,
        )
    except BaseException:  # noqa: B036 - reported to the rank, which raises EngineDiedError
        conn.send(("failed", traceback.format_exc()))
        kill_tree(os.getpid(), include_root=False)
        os._exit(1)
    engine.loop.run_until_complete(_EngineHost(engine, conn, config.tp_size).serve())


class _EngineHost:
    """Serves the rank's calls on the engine's event loop, several at a time."""

    def __init__(self, engine, conn, tp_size: int):
        from sglang.srt.managers import io_struct

        self.io = io_struct
        self.engine = engine
        self.tm = engine.tokenizer_manager
        self.conn = conn
        self.tp_size = tp_size
        self.child_pids: list[int] = engine.get_all_child_pids()
        self.stopped = asyncio.Event()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        # Let SGLang install its handlers now, then replace its SIGQUIT one (which kills the
        # process tree without a word) with ours, which reports the cause first.
        self.tm.auto_create_handle_loop()
        loop.add_signal_handler(signal.SIGQUIT, self._on_child_failure)
        threading.Thread(target=self._read_calls, args=(loop,), daemon=True).start()
        self.conn.send(("ready", {"child_pids": self.child_pids}))
        await self.stopped.wait()

    def _read_calls(self, loop) -> None:
        while True:
            try:
                _, call_id, method, kwargs = self.conn.recv()
            except (EOFError, OSError):  # the rank is gone: stop the engine with it
                call_id, method, kwargs = -1, "shutdown", {}
            loop.call_soon_threadsafe(
                lambda *a: loop.create_task(self._run(*a)), call_id, method, kwargs
            )
            if method == "shutdown":
                return

    async def _run(self, call_id: int, method: str, kwargs: dict) -> None:
        try:
            reply = ("ok", call_id, await getattr(self, f"rpc_{method}")(**kwargs))
        except Exception as exc:  # noqa: BLE001 - re-raised in the rank
            exc.add_note(f"in the SGLang engine host:\n{traceback.format_exc()}")
            reply = ("error", call_id, exc)
        try:
            self.conn.send(reply)
        except (OSError, EOFError):
            pass  # the rank is gone; its pipe closing shuts this host down
        except Exception as exc:  # noqa: BLE001 - e.g. an exception that does not pickle
            self.conn.send(("error", call_id, RuntimeError(f"{method}: {exc!r}")))

    def _on_child_failure(self) -> None:
        # A child sends SIGQUIT just before it exits; give it a moment to report an exit code.
        watchdog = self.tm._subprocess_watchdog
        procs = list(zip(getattr(watchdog, "_processes", []), getattr(watchdog, "_names", [])))
        deadline = time.monotonic() + 3.0
        while all(p.is_alive() for p, _ in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [
            f"{name} (pid {p.pid}) exited with code {p.exitcode}"
            for p, name in procs
            if not p.is_alive()
        ]
        cause = "; ".join(dead) or "an SGLang child process reported a failure (SIGQUIT)"
        try:
            self.conn.send(("died", cause + "; its traceback, if any, is in the log above"))
        finally:
            kill_tree(os.getpid(), include_root=False)
            os._exit(HOST_EXIT_CHILD_DIED)

    @staticmethod
    def _check(what: str, result) -> None:
        success, message = result[0], result[1]
        if not success:
            raise RuntimeError(f"SGLang refused {what}: {message}")

    async def rpc_generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        obj = self.io.GenerateReqInput(
            input_ids=[r.input_ids for r in requests],
            sampling_params=[_sampling_dict(r) for r in requests],
            rid=[r.rid for r in requests],
            return_logprob=True,
        )
        outputs = await self.tm.generate_request(obj, None).__anext__()
        return [_to_result(r.rid, out) for r, out in zip(requests, outputs)]

    async def rpc_begin_weight_update(self) -> None:
        obj = self.io.BeginWeightUpdateReqInput()
        self._check("begin_weight_update", await self.tm.begin_weight_update(obj, None))

    async def rpc_update_weights(self, named_tensors, version: str, flush_cache: bool) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        # One payload per TP rank: each rank deserializes its own copy (as Engine does).
        payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.tp_size)]
        obj = self.io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, flush_cache=flush_cache, weight_version=version
        )
        self._check("update_weights", await self.tm.update_weights_from_tensor(obj, None))

    async def rpc_end_weight_update(self) -> None:
        obj = self.io.EndWeightUpdateReqInput()
        self._check("end_weight_update", await self.tm.end_weight_update(obj, None))

    async def rpc_weight_version(self) -> str:
        return str(self.tm.config_value("weight_version"))

    async def rpc_pause(self, mode: str) -> None:
        await self.tm.pause_generation(self.io.PauseGenerationReqInput(mode=mode))

    async def rpc_resume(self) -> None:
        await self.tm.continue_generation(self.io.ContinueGenerationReqInput())

    async def rpc_abort(self, rid: str | None) -> None:
        self.tm.abort_request(rid=rid or "", abort_all=rid is None)

    async def rpc_flush_cache(self) -> None:
        result = await self.tm.flush_cache()
        if not result.success:
            raise RuntimeError(f"SGLang refused flush_cache (requests in flight?): {result}")

    async def rpc_health(self) -> bool:
        import psutil

        try:
            procs = [psutil.Process(pid) for pid in self.child_pids]
            return all(p.status() != psutil.STATUS_ZOMBIE for p in procs)
        except psutil.NoSuchProcess:
            return False

    async def rpc_get_weights_by_name(self, name: str) -> torch.Tensor:
        obj = self.io.GetWeightsByNameReqInput(name=name, truncate_size=2**31 - 1)
        values = await self.tm.get_weights_by_name(obj, None)
        if values is None:
            raise KeyError(
                f"SGLang has no weight {name!r} (or its model lacks get_weights_by_name)"
            )
        return torch.tensor(values, dtype=torch.float32)

    async def rpc_shutdown(self) -> None:
        self.engine.shutdown()
        self.stopped.set()


def _sampling_dict(request: GenerateRequest) -> dict[str, Any]:
    s = request.sampling
    params = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    return params


def _to_result(rid: str, out: dict) -> GenerateResult:
    meta = out["meta_info"]
    output_ids = list(out["output_ids"])
    spans = meta.get("weight_versions") or [
        {"version": meta["weight_version"], "start": 0, "end": len(output_ids)}
    ]
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        output_logprobs=[float(lp) for lp, *_ in meta["output_token_logprobs"]],
        token_versions=expand_version_spans(spans, len(output_ids)),
        finish_reason=str(meta["finish_reason"]["type"]),
    )


def kill_tree(pid: int | None, include_root: bool = True, also: Sequence = ()) -> None:
    """SIGKILL `pid`'s descendants, `pid` itself and the psutil processes `also`; wait for them.

    `also` covers orphans: engine children whose host already died are no longer its
    descendants. psutil refuses to signal a pid that was reused by another process.
    """
    import psutil

    procs = list(also)
    try:
        if pid is not None:  # psutil.Process(None) would be this very process
            root = psutil.Process(pid)
            procs += root.children(recursive=True) + ([root] if include_root else [])
    except psutil.NoSuchProcess:
        pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(_running(p) for p in procs):
        time.sleep(0.05)


def processes(pids: Sequence[int]) -> list:
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return procs


def _running(proc) -> bool:
    """Alive and not a zombie (an orphaned zombie may never be reaped in a container)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
