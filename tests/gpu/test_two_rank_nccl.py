"""Two CUDA ranks on NCCL: the device discipline where it matters (review findings 2 and 3).

Contract: each rank's `Platform.device()` is its own GPU from its main thread and from a worker
thread; a CUDA tensor sent through `devices.all_gather_object` arrives on the CPU on the other
rank (torch alone would rebuild it on the sender's GPU index), and `devices.to_device` puts it
on the receiver's own GPU; an NCCL all-reduce on each rank's device sums both. Marked `gpu`;
skipped, saying so, with fewer than two GPUs. Nothing is faked.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


def _rank(rank: int, world_size: int, init_file: str, out: dict) -> None:
    import torch.distributed as dist

    from megatron_async_rl.distributed import devices
    from megatron_async_rl.distributed.platform import detect_platform, init_distributed

    os.environ["LOCAL_RANK"] = str(rank)
    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        device, seen = platform.device(), []
        worker = threading.Thread(target=lambda: seen.append(platform.device()))
        worker.start()
        worker.join()
        gloo = dist.new_group(list(range(world_size)), backend="gloo")
        parts = [None] * world_size
        devices.all_gather_object(parts, {"x": torch.full((3,), float(rank), device=device)}, gloo)
        moved = [devices.to_device(p["x"], device) for p in parts]
        total = torch.ones(1, device=device) * (rank + 1)
        dist.all_reduce(total)
        out[rank] = dict(device=str(device), thread=str(seen[0]),
                         arrived=[str(p["x"].device) for p in parts],
                         moved=[str(m.device) for m in moved], total=total.item())  # fmt: skip
    finally:
        dist.destroy_process_group()


def _entry(rank, world_size, init_file, queue):
    out: dict = {}
    _rank(rank, world_size, init_file, out)
    queue.put(out)


def test_two_ranks_keep_their_own_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, 2, str(tmp_path / "rdv"), queue))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        results.update(queue.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        r = results[rank]
        assert r["device"] == r["thread"] == f"cuda:{rank}"
        assert r["arrived"] == ["cpu", "cpu"] and r["moved"] == [f"cuda:{rank}"] * 2
        assert r["total"] == 3.0
