"""The SGLang engine host: what runs inside the child process a generate rank spawns.

Owned here: starting `sglang.Engine` in that child (after dropping the launcher's environment
and, on CPU, putting the import shims first), serving the rank's calls on the engine's event
loop, reporting which engine process died, and the process-tree helpers both sides use. This is
the only module of the package that imports `sglang`, and only inside `host_main`. The rank side
(`SGLangEngine`, the pipe protocol, timeouts) is `engines/sglang/engine.py`; read its docstring
for why the engine lives in a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor pickling for the pipe

from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    expand_version_spans,
)
from megatron_async_rl.engines.recovery.progress import ProgressReporter
from megatron_async_rl.engines.sglang import kernel_free
from megatron_async_rl.engines.sglang.tp_shards import assemble_hf_tensor

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


# SGLang's own CPU default is `intel_amx` on an x86 CPU with AMX tiles, which needs sgl-kernel's
# CPU build (not published; the shim in cpu_shims/ registers none of its ops), and it falls back
# to `torch_native` only after probing for those kernels. Named here, the backend is the same on
# every CPU; cpu_shims/sitecustomize.py makes multi-latent attention (DeepSeek) run on it.
CPU_ATTENTION_BACKEND = "torch_native"
CPU_ATTENTION_ENV = "MEGATRON_ASYNC_RL_CPU_ATTENTION"
"""`engine.cpu_attention` for the engine's processes: `cpu_shims/sitecustomize.py` installs the
batched torch-native backend (`batched_attention.py`) unless it is `per_request`."""


def engine_kwargs(config: SGLangEngineConfig, has_sgl_kernel: bool | None = None
                  ) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of `sglang.Engine` for `config`; the recipe's `server_args` win over
    the optional ones. `has_sgl_kernel`: whether sgl-kernel imports here (None: look)."""
    cpu = config.device == "cpu"
    optional = {
        "max_total_tokens": config.max_total_tokens,
        "mem_fraction_static": config.mem_fraction_static,
        # SGLang's idle scheduler otherwise spins a core: on CPU, that core is the trainer's
        # or the weight sync's (measured: weight sync 0.140 -> 0.116 s, raw broadcast alike).
        "sleep_on_idle": True if cpu else None,
        "attention_backend": CPU_ATTENTION_BACKEND if cpu else None,
        # MoE routing replay: SGLang keeps each token's experts
        "enable_return_routed_experts": True if config.routing is not None else None,
        # Requests come as token ids and results are read as token ids: the ranks tokenize and
        # decode themselves (with the run's tokenizer, stop tokens passed explicitly), so the
        # engine's detokenizer, which decodes every request's new tokens at every step, is
        # work nobody reads. Measured on the quick start's batch on CPU: a generate call 13-25%
        # faster, token ids and log-probs identical (`tests/distributed/test_sglang_engine.py`).
        "skip_tokenizer_init": True,
    }
    kwargs = {k: v for k, v in optional.items() if v is not None}
    if not cpu:
        has = kernel_free.has_sgl_kernel() if has_sgl_kernel is None else has_sgl_kernel
        kwargs.update(kernel_free.kernel_free_args(config.device, has))
    kwargs.update(config.server_args)
    return dict(  # a server_args key naming one of these is a TypeError, as in sglang.Engine
        model_path=config.model_path,
        device=config.device,
        tp_size=config.tp_size,
        dtype=config.dtype,
        random_seed=config.random_seed,
        log_level=config.log_level,
        **kwargs,
    )


def host_main(conn, config: SGLangEngineConfig) -> None:
    """Entry point of the engine host: start `sglang.Engine`, then serve calls until shutdown."""
    # A preemption's SIGTERM is for the ranks, which finish a step and save before they stop
    # their engines: torchrun signals its workers' process groups (hence a session of its
    # own), SLURM every process of the step (hence ignored here and, inherited, in SGLang's
    # processes; SGLang's own shutdown kills with SIGKILL). The host still ends with the
    # rank: its pipe closes (`_read_calls`).
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _scrub_launcher_env()
    if config.device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ[CPU_ATTENTION_ENV] = config.cpu_attention
        _put_first_on_path(CPU_SHIMS_DIR, os.environ)
        # Its SGLang patches (import hooks), which a process gets at start-up from PYTHONPATH:
        # this one started before, and forked processes start from it.
        _run_cpu_shims_site()
        if config.tp_size > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
            # Without it SGLang's CPU TP asserts one NUMA node per TP rank.
            bind = cpu_threads_bind(config.tp_size, sorted(os.sched_getaffinity(0)))
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind
    elif config.device == "cuda" and not kernel_free.has_sgl_kernel():
        use_kernel_free_shims(os.environ)
    try:
        import sglang

        start_engine_processes_by(config.start_method)
        engine = sglang.Engine(**engine_kwargs(config))
    except BaseException:  # noqa: B036 - reported to the rank, which raises EngineDiedError
        conn.send(("failed", traceback.format_exc()))
        kill_tree(os.getpid(), include_root=False)
        os._exit(1)
    engine.loop.run_until_complete(_EngineHost(engine, conn, config).serve())


def _put_first_on_path(directory: Path, environ) -> None:
    """`directory` first on this process's path and, through `environ`'s PYTHONPATH, on that
    of the SGLang processes it starts."""
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(directory), environ.get("PYTHONPATH")) if p
    )
    sys.path.insert(0, str(directory))  # spawn copied the parent's sys.path over PYTHONPATH


def use_kernel_free_shims(environ) -> None:
    """On CUDA without sgl-kernel, before SGLang is imported: SGLang's switches
    (`kernel_free.ENGINE_ENV`) in `environ`, the `sgl_kernel` stand-in first on the path."""
    environ.update(kernel_free.ENGINE_ENV)
    _put_first_on_path(kernel_free.SHIMS_DIR, environ)


def _run_cpu_shims_site() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_megatron_async_rl_cpu_shims_site", CPU_SHIMS_DIR / "sitecustomize.py"
    )
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def start_engine_processes_by(method: str) -> None:
    """Have `sglang.Engine` start its scheduler and detokenizer processes with `method`.

    SGLang sets `spawn` (`_set_envs_and_config`, just before it launches them), so each of them
    imports SGLang and torch anew. Measured on 2 CPU cores, tiny model, TP=1: the host took 16 CPU
    seconds to import, the scheduler 22 and the detokenizer 15; forked from this host after its
    imports, 5.5 and 0.1, and the engine served in 22 s instead of 41 (TP=2: 21 instead of 43).
    This host has no thread of its own then (its serving threads start once the engine is up).
    Where SGLang no longer sets the method there, it is left alone (spawn: slower, as correct)."""
    if method == "spawn":
        return
    from sglang.srt.entrypoints import engine as entry

    set_envs = getattr(entry, "_set_envs_and_config", None)
    if set_envs is None:
        logger.warning("SGLang has no _set_envs_and_config: its processes start with its own "
                       "start method, not %s", method)  # fmt: skip
        return

    def then_set_start_method(*args, **kwargs):
        set_envs(*args, **kwargs)
        multiprocessing.set_start_method(method, force=True)

    entry._set_envs_and_config = then_set_start_method


class _EngineHost:
    """Serves the rank's calls on the engine's event loop, several at a time."""

    def __init__(self, engine, conn, config: SGLangEngineConfig):
        from sglang.srt.managers import io_struct

        self.io = io_struct
        self.engine = engine
        self.tm = engine.tokenizer_manager
        self.conn = conn
        self.config = config
        self.tp_size = config.tp_size
        self.child_pids: list[int] = engine.get_all_child_pids()
        self.stopped = asyncio.Event()
        self._shards: _ShardDump | None = None  # TP > 1 read-back; dropped on weight updates
        self.progress = ProgressReporter(self._send_quietly)
        self._progress_sent = 0.0

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        # Let SGLang install its handlers now, then replace its SIGQUIT one (which kills the
        # process tree without a word) with ours, which reports the cause first.
        self.tm.auto_create_handle_loop()
        loop.add_signal_handler(signal.SIGQUIT, self._on_child_failure)
        loop.remove_signal_handler(signal.SIGTERM)  # SGLang's drains and exits: see host_main
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=self._read_calls, args=(loop,), daemon=True).start()
        resolved = self.tm.server_args.resolved_dict()  # its launch config, defaults decided
        info = {
            "child_pids": self.child_pids,
            "files": self._own_files(),
            # what SGLang accepts per request
            "max_input_tokens": self.tm.max_req_input_len,
            "context_tokens": self.tm.context_len,
            "attention_backend": resolved["attention_backend"],
            "start_method": multiprocessing.get_start_method(),  # its processes'
        }
        with contextlib.suppress(OSError):  # the rank is gone: _read_calls shuts down
            self.conn.send(("ready", info))
        await self.stopped.wait()

    def _own_files(self) -> list[str]:
        """Files SGLang creates for this engine and never removes (its load-snapshot slot file
        in /dev/shm): the rank removes them once the engine is gone, however it ended."""
        from sglang.srt.managers.load_snapshot import shm_path_for

        instance_id = getattr(getattr(self.engine, "port_args", None), "instance_id", "")
        return [shm_path_for(instance_id)] if instance_id else []

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
            self.progress.flush()  # the tokens streamed since the last report
            self.conn.send(("died", cause + "; its traceback, if any, is in the log above"))
        finally:
            kill_tree(os.getpid(), include_root=False)
            os._exit(HOST_EXIT_CHILD_DIED)

    def _send_quietly(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (OSError, EOFError):
            pass  # the rank is gone; its pipe closing shuts this host down

    @staticmethod
    def _check(what: str, result) -> None:
        success, message = result[0], result[1]
        if not success:
            raise RuntimeError(f"SGLang refused {what}: {message}")

    async def rpc_generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        every = self.config.progress_every_tokens
        params = [_sampling_dict(r) for r in requests]
        for p in params if every else ():
            p["stream_interval"] = every
        obj = self.io.GenerateReqInput(
            input_ids=[r.input_ids for r in requests],
            sampling_params=params,
            rid=[r.rid for r in requests],
            return_logprob=True,
            stream=bool(every),
            return_routed_experts=self.config.routing is not None,
        )
        routing = self.config.routing
        if not every:
            outputs = await self.tm.generate_request(obj, None).__anext__()
            return [_to_result(r.rid, out, routing) for r, out in zip(requests, outputs)]
        # Streamed: the newest output of each request is reported to the rank as it goes
        # (`engines.recovery.progress`), so a request cut by a death goes on from its prefix.
        final: list[dict | None] = [None] * len(requests)
        try:
            async for out in self.tm.generate_request(obj, None):
                index = out["index"]
                self.progress.record(requests[index].rid, out)
                if out["meta_info"].get("finish_reason"):
                    final[index] = out
                self._progress_due()
        finally:
            self.progress.forget(r.rid for r in requests)
        missing = [r.rid for r, out in zip(requests, final) if out is None]
        if missing:
            raise RuntimeError(f"SGLang's stream ended without a final output for {missing}")
        return [_to_result(r.rid, out, routing) for r, out in zip(requests, final)]

    def _progress_due(self) -> None:
        now = time.monotonic()
        if now - self._progress_sent >= self.config.progress_every_s:
            self._progress_sent = now
            self.progress.flush()

    async def rpc_begin_weight_update(self) -> None:
        self._drop_shards()
        obj = self.io.BeginWeightUpdateReqInput()
        self._check("begin_weight_update", await self.tm.begin_weight_update(obj, None))

    async def rpc_update_weights(
        self, payloads: list[bytes], load_format: str | None, version: str, flush_cache: bool
    ) -> None:
        """`payloads`: one per TP rank, pickled by the rank that owns the tensors
        (`handover.serialize`); each scheduler deserializes its own."""
        self._drop_shards()
        obj = self.io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads,
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=version,
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

    async def rpc_ping(self) -> bool:
        """A round trip to every scheduler (its internal state): answered while paused or
        between weight loads, unlike a generate request."""
        await self.tm.get_internal_state()
        return True

    async def rpc_get_weights_by_name(self, name: str) -> torch.Tensor:
        if self.tp_size > 1:
            # SGLang's get_weights_by_name answers from TP rank 0 only: its shard of column-
            # parallel weights (q/k/v, gate/up, vocab rows), the all-gathered row-parallel ones.
            if self._shards is None:
                self._shards = await asyncio.to_thread(self._dump_shards)
            hf_config = json.loads((Path(self.config.model_path) / "config.json").read_text())
            return assemble_hf_tensor(name, self._shards.read, self.tp_size, hf_config)
        obj = self.io.GetWeightsByNameReqInput(name=name, truncate_size=2**31 - 1)
        values = await self.tm.get_weights_by_name(obj, None)
        if values is None:
            raise KeyError(
                f"SGLang has no weight {name!r} (or its model lacks get_weights_by_name)"
            )
        return torch.tensor(values, dtype=torch.float32)

    def _dump_shards(self) -> _ShardDump:
        """Every TP rank writes its own parameters (SGLang's `save_sharded_model`)."""
        directory = Path(tempfile.mkdtemp(prefix="sglang-tp-shards-"))
        try:
            self.engine.collective_rpc(
                "save_sharded_model", path=str(directory), pattern=None, max_size=None
            )
            return _ShardDump(directory, self.tp_size)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def _drop_shards(self) -> None:
        if self._shards is not None:
            shutil.rmtree(self._shards.directory, ignore_errors=True)
            self._shards = None

    async def rpc_shutdown(self) -> None:
        self._drop_shards()
        self.engine.shutdown()
        # The rank removes these too (however the engine ended); here for a rank that was
        # killed: its pipe closed and brought us here.
        for path in self._own_files():
            with contextlib.suppress(OSError):
                os.remove(path)
        self.stopped.set()


class _ShardDump:
    """SGLang's parameters as each TP rank holds them (its names: fused qkv_proj, gate_up_proj;
    vocab rows padded), dumped to safetensors files and read one tensor at a time."""

    def __init__(self, directory: Path, tp_size: int):
        from safetensors import safe_open

        self.directory = directory
        self._files: list[dict[str, Path]] = []
        for rank in range(tp_size):
            keys: dict[str, Path] = {}
            for path in sorted(directory.glob(f"model-rank-{rank}-part-*.safetensors")):
                with safe_open(path, framework="pt") as f:
                    keys.update(dict.fromkeys(f.keys(), path))
            if not keys:
                raise RuntimeError(f"SGLang TP rank {rank} wrote no parameters to {directory}")
            self._files.append(keys)

    def read(self, rank: int, key: str) -> torch.Tensor | None:
        from safetensors import safe_open

        path = self._files[rank].get(key)
        if path is None:
            return None
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key)


def cpu_threads_bind(tp_size: int, cpus: Sequence[int]) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `tp_size` ranks: `cpus` split into contiguous groups
    of near-equal size, e.g. "0|1" for 2 ranks on 2 cores, "0-3|4-7" on 8; with fewer cores
    than ranks, ranks share cores round-robin."""
    if not cpus:
        raise ValueError("cpu_threads_bind: no CPU cores available to this process")
    if len(cpus) < tp_size:
        groups = [[cpus[rank % len(cpus)]] for rank in range(tp_size)]
    else:
        base, extra = divmod(len(cpus), tp_size)
        bounds = [rank * base + min(rank, extra) for rank in range(tp_size + 1)]
        groups = [list(cpus[bounds[r] : bounds[r + 1]]) for r in range(tp_size)]

    def spell(group: list[int]) -> str:
        if len(group) > 1 and group == list(range(group[0], group[-1] + 1)):
            return f"{group[0]}-{group[-1]}"
        return ",".join(map(str, group))

    return "|".join(spell(group) for group in groups)


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
    if s.ignore_eos:
        params["ignore_eos"] = True
    return params


def _to_result(rid: str, out: dict, routing=None) -> GenerateResult:
    meta = out["meta_info"]
    output_ids = list(out["output_ids"])
    experts = None
    if routing is not None and meta.get("routed_experts") is not None:
        from megatron_async_rl.moe.routing import decode_engine_routing

        experts = decode_engine_routing(meta["routed_experts"], routing.num_layers,
                                        routing.topk, routing.layers, routing.num_experts)
    spans = meta.get("weight_versions") or [
        {"version": meta["weight_version"], "start": 0, "end": len(output_ids)}
    ]
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        output_logprobs=[float(lp) for lp, *_ in meta["output_token_logprobs"]],
        token_versions=expand_version_spans(spans, len(output_ids)),
        finish_reason=str(meta["finish_reason"]["type"]),
        routed_experts=experts,
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
