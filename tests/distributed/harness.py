"""Spawn N gloo ranks on CPU with a file-store rendezvous in a test's tmp_path.

Used by every test in tests/distributed. A worker is a module-level function
`fn(rank, world_size, tmp_dir, *args)` that returns a picklable result; `spawn` returns the
results indexed by rank, and re-raises the first worker failure with its traceback.
"""

from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp


def _entry(rank, world_size, tmp_dir, fn, args, results):
    import warnings

    # megatron-core warns at import about every optional GPU package it lacks.
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    import torch

    torch.set_num_threads(1)
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
        results[rank] = ("ok", fn(rank, world_size, tmp_dir, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, tmp_path, *args):
    """Run `fn` on `world_size` ranks; return the list of per-rank results."""
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    try:
        mp.start_processes(
            _entry,
            args=(world_size, str(tmp_path), fn, args, results),
            nprocs=world_size,
            start_method="spawn",
        )
    except mp.ProcessRaisedException:
        errors = [v[1] for v in results.values() if v[0] == "error"]
        raise AssertionError("worker failed:\n" + "\n".join(errors)) from None
    return [results[rank][1] for rank in range(world_size)]
