"""Weight sync on one rank that trains and receives its own messages, slots on a given device.

Contract: `executor.run_plan` with its slots on `device` (CPU here, with gloo; CUDA with NCCL in
`tests/gpu/test_weight_sync_cuda.py`, the device bridge, which runs this very body) stages every
HF tensor on the host equal to the trainer's, bit for bit, on two syncs with pooled slots.
Nothing is faked.
"""

from __future__ import annotations

import torch

from megatron_async_rl.models import name_map as nm
from megatron_async_rl.weight_sync import buffers, executor, sinks
from megatron_async_rl.weight_sync.plan import TrainLayout, build_plan
from tests.distributed.harness import spawn
from tests.unit.test_weight_sync_buffers import DIMS


def _one_rank_sync(device_type: str) -> list[str]:
    """Names whose staged tensor differs from the trainer's, after two syncs (pooled slots)."""
    import torch.distributed as dist

    device = torch.device("cuda", 0) if device_type == "cuda" else None
    plan = build_plan(TrainLayout(offset=0, tp=1, pp=1, dp=1), DIMS, "float32", 64 << 10, 16 << 10)
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in plan.hf_shapes}
    full = nm.hf_to_megatron(hf, DIMS)
    local = nm.stage_state_dict(full, DIMS, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    local = {k: v.to(device or "cpu") for k, v in local.items()}
    group = dist.new_group([0])
    pool, bad = buffers.BufferPool(), []
    for version in (1, 2):
        counter = buffers.MemoryCounter()
        sink = sinks.StagingSink(plan, counter, version, plan.consume_bytes, pool)
        stats = executor.run_plan(
            plan, 0, version, {0: group}, local=local, tp_groups={}, sink=sink,
            counter=counter, pool=pool, device=device,
        )  # fmt: skip
        assert stats.error is None, stats.error
        # Produce and consume slots on the device; the staging arena is host shared memory.
        slots = [b for (kind, _), b in pool._buffers.items() if kind != "staging" and b.numel()]
        assert slots and all(b.device.type == device_type for b in slots)
        bad += [n for n, t in hf.items() if not torch.equal(sink.weights[n].cpu(), t)]
    return bad


def _worker(rank, world_size, tmp_dir):
    return _one_rank_sync("cpu")


def test_one_rank_sync_on_cpu_is_exact(tmp_path):
    assert spawn(_worker, 1, tmp_path) == [[]]
