"""Why --use-megatron-fsdp is refused (config/megatron_lm.py `_FSDP`), checked against the
pinned megatron-core rather than taken on trust: its adapter (`distributed/fsdp/
mcore_fsdp_adapter.py`, 0.16.1) reads the *global* tensor-parallel group, which roles built from
explicit groups never initialise (the same AssertionError on an H100, one NCCL rank, given a full
`pg_collection`), and it lays its device mesh over the whole world, which here also holds the
engine ranks. If a megatron-core upgrade lifts either, these tests fail: revisit the refusal.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import spawn


def test_the_adapter_reads_the_global_tensor_parallel_group():
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    assert parallel_state.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        FullyShardedDataParallel._fix_tensor_parallel_attributes(None, torch.nn.Linear(2, 2))


def _mesh_of_a_one_rank_role(rank, world_size, tmp_dir):
    """World of 2: the role is rank 0 alone (rank 1 stands for an engine rank)."""
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _get_dp_tp_mesh

    own = [dist.new_group([r]) for r in range(world_size)][rank]  # dp = tp = {rank}
    try:
        _get_dp_tp_mesh(own, own)
    except Exception as error:  # noqa: BLE001 - the type is einops' or an AssertionError
        return f"{type(error).__name__}: {error}"
    return None


def test_the_adapter_meshes_the_whole_world(tmp_path):
    errors = spawn(_mesh_of_a_one_rank_role, 2, tmp_path)
    assert all(errors), "a 1-rank role in a 2-rank world got a mesh: revisit the refusal"
