"""Weight sync on one rank that trains and receives its own messages, inside a rank, with its
slots on a given device: run by `tests/distributed/test_weight_sync_one_rank.py` (CPU, gloo) and
`tests/gpu/test_weight_sync_cuda.py` (CUDA, NCCL). `DIMS` is the small dense model the
weight-sync unit tests plan for (`tests/unit/test_weight_sync_buffers.py`).
"""

from __future__ import annotations

import torch

from megatron_async_rl.models.dims import ModelDims
from megatron_async_rl.models.names import hf_to_megatron
from megatron_async_rl.models.shards import stage_state_dict
from megatron_async_rl.weight_sync import buffers, executor, sinks
from megatron_async_rl.weight_sync.plan import TrainLayout, build_plan

DIMS = ModelDims(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
    ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128, tied_embeddings=False,
    add_qkv_bias=False, qk_layernorm=False,
)  # fmt: skip


def one_rank_sync(device_type: str) -> list[str]:
    """Names whose staged tensor differs from the trainer's, after two syncs (pooled slots)."""
    import torch.distributed as dist

    device = torch.device("cuda", 0) if device_type == "cuda" else None
    plan = build_plan(TrainLayout(offset=0, tp=1, pp=1, dp=1), DIMS, "float32", 64 << 10, 16 << 10)
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in plan.hf_shapes}
    full = hf_to_megatron(hf, DIMS)
    local = stage_state_dict(full, DIMS, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
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
