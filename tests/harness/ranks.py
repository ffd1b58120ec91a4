"""Spawn N gloo ranks on CPU with a file-store rendezvous in a test's tmp_path.

Used by every test in tests/distributed, by tests/gpu and by benchmarks/. A worker is a
module-level function `fn(rank, world_size, tmp_dir, *args)` that returns a picklable result;
`spawn` returns the results indexed by rank, and re-raises the first worker failure with its
traceback.

Ranks start from a `forkserver` (`START_METHOD`) that has imported `rank_preload` once for the
session (torch, megatron-core, the package's role, group and weight-sync modules), so a rank is a
fork of a warm interpreter instead of a fresh one importing all of it again. That is safe here:
the server holds no threads, no process group and no CUDA state, and OMP_NUM_THREADS is 1
(tests/conftest.py). An SGLang engine a rank starts is still its own spawned host process
(`engines/sglang/engine.py`). Each rank writes its result to a file in `tmp_dir`.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.multiprocessing as mp

# "spawn" starts every rank from a fresh interpreter (slower; for a suspected fork problem).
START_METHOD = os.environ.get("MEGATRON_ASYNC_RL_TEST_START_METHOD", "forkserver")


def _entry(rank, world_size, tmp_dir, fn, args):
    import warnings

    # megatron-core warns at import about every optional GPU package it lacks.
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    _adopt_orphans()
    try:
        from megatron_async_rl.distributed.platform import detect_platform, init_distributed

        platform = detect_platform("cpu", "gloo")
        init_distributed(
            platform,
            init_method=f"file://{tmp_dir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout_s=120,
        )
        torch.save(("ok", fn(rank, world_size, tmp_dir, *args)), _result_file(tmp_dir, rank))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        torch.save(("error", traceback.format_exc()), _result_file(tmp_dir, rank))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _kill_leftovers()


def _adopt_orphans() -> None:
    """Make this rank the parent of every orphaned descendant (PR_SET_CHILD_SUBREAPER).

    Every forkserver child holds the write end of the server's liveness pipe; a process a
    rank forked and left behind (seen: one that outlived its rank, blocked on a pipe, from
    tests/distributed/test_checkpoint_megatron.py) holds it too, so the server never sees the
    end of the session and pytest waits for it at exit, forever. Adopted, `_kill_leftovers`
    finds them."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _kill_leftovers() -> None:
    """SIGKILL what this rank leaves running (an engine or writer its test did not stop)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)


def _result_file(tmp_dir, rank: int) -> str:
    return os.path.join(tmp_dir, f"result-{rank}.pt")


def spawn(fn, world_size: int, tmp_path, *args):
    """Run `fn` on `world_size` ranks; return the list of per-rank results."""
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload(["tests.harness.rank_preload"])  # before the server starts
    tmp_dir = str(tmp_path)
    for rank in range(world_size):  # a result left by an earlier world in the same directory
        if os.path.exists(_result_file(tmp_dir, rank)):
            os.remove(_result_file(tmp_dir, rank))
    try:
        mp.start_processes(
            _entry,
            args=(world_size, tmp_dir, fn, args),
            nprocs=world_size,
            start_method=START_METHOD,
        )
    except mp.ProcessRaisedException:
        errors = [r[1] for r in _results(tmp_dir, world_size) if r is not None and r[0] == "error"]
        raise AssertionError("worker failed:\n" + "\n".join(errors)) from None
    return [result[1] for result in _results(tmp_dir, world_size)]


def _results(tmp_dir, world_size: int):
    """Each rank's (status, payload), None for a rank that wrote none."""
    out = []
    for rank in range(world_size):
        path = _result_file(tmp_dir, rank)
        out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return out
