"""The device bridge of weight sync on one CUDA rank: slots, packing, checksum and staging.

Contract: `tests/distributed/test_weight_sync_one_rank.py`'s body (`tests/harness/weight_sync.py`)
with its slots on the GPU and NCCL: every staged HF tensor equals the trainer's; the checksum is
`buffers.device_checksum`, computed on the GPU, and equals the CPU value of the same bytes.
Marked `gpu`, skipped without one. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from megatron_async_rl.weight_sync import buffers
from tests.harness.weight_sync import one_rank_sync


@pytest.mark.gpu
def test_device_checksum_on_cuda_equals_the_cpu_value():
    payload = torch.randint(0, 256, ((9 << 20) + 13,), dtype=torch.uint8)
    on_gpu = buffers.checksum(payload.cuda())  # dispatches to device_checksum on the GPU
    assert on_gpu == buffers.device_checksum(payload)
    assert on_gpu != buffers.checksum(payload)  # the CPU path is XXH3


@pytest.mark.gpu
def test_one_rank_sync_on_cuda_is_exact(tmp_path):
    import torch.distributed as dist

    from megatron_async_rl.distributed.platform import detect_platform, init_distributed

    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        assert one_rank_sync("cuda") == []
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_staging_arena_is_pinned_shared_memory_on_cuda():
    """Finding 9: an asynchronous engine host's staging arena is page-locked shared memory;
    a replaced buffer is unregistered first (registering a freed mapping would fail later)."""
    pool = buffers.BufferPool()
    views, total = buffers.shared_arena([("w", (1024, 1024), torch.bfloat16)], pool, True)
    assert pool.is_pinned("staging", 0) and views["w"].is_pinned() and views["w"].is_shared()
    source = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    views["w"].copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(views["w"], source.cpu())
    bigger, _ = buffers.shared_arena([("w", (2048, 1024), torch.bfloat16)], pool, True)
    assert pool.is_pinned("staging", 0) and bigger["w"].is_pinned()
