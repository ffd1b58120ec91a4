"""Weight sync on one rank that trains and receives its own messages, slots on a given device.

Contract: `executor.run_plan` with its slots on `device` (CPU here, with gloo; CUDA with NCCL in
`tests/gpu/test_weight_sync_cuda.py`, the device bridge, which runs this very body) stages every
HF tensor on the host equal to the trainer's, bit for bit, on two syncs with pooled slots.
Nothing is faked.
"""

from __future__ import annotations

from tests.harness.ranks import spawn
from tests.harness.weight_sync import one_rank_sync


def _worker(rank, world_size, tmp_dir):
    return one_rank_sync("cpu")


def test_one_rank_sync_on_cpu_is_exact(tmp_path):
    assert spawn(_worker, 1, tmp_path) == [[]]
