"""Engine followers in the carved world (`distributed/groups.py` with `engine_tp_size` > 1).

Contract: on 3 gloo ranks laid out as train+logp+ref (rank 0) and generate (ranks 1-2),
`engine_tp_size=2` makes rank 1 the engine host and rank 2 a follower: the `samples` and
`weight_sync` groups hold ranks 0-1 only (None on rank 2) and carry a collective among those
ranks while the follower stays out; with `engine_tp_size=1` both groups hold every generate rank,
as before. Nothing is faked.
"""

from __future__ import annotations

import pytest

from tests.harness.ranks import spawn

pytestmark = pytest.mark.slow  # 1-2 min on 2 busy cores: three ranks import megatron-core


def _worker(rank, world_size, tmp_dir):
    import torch.distributed as dist

    from megatron_async_rl.config.roles import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import plan_layout

    specs = [
        RoleGroupSpec(["train", "logp", "ref"], num_ranks=1),
        RoleGroupSpec(["generate"], num_ranks=2),
    ]
    out = {}
    for tp in (1, 2):
        groups = build_world_groups(plan_layout(world_size, specs, {}, engine_tp_size=tp), "gloo")
        seen = None
        if groups.samples is not None:
            seen = [None] * dist.get_world_size(groups.samples)
            dist.all_gather_object(seen, rank, group=groups.samples)
        payload = [f"weights from {rank}"]
        if groups.weight_sync is not None:
            src = groups.weight_sync_ranks[0]
            dist.broadcast_object_list(payload, src=src, group=groups.weight_sync)
        out[tp] = {
            "samples_ranks": groups.samples_ranks,
            "weight_sync_ranks": groups.weight_sync_ranks,
            "member": (groups.samples is not None, groups.weight_sync is not None),
            "seen": seen,
            "payload": payload[0],
        }
        dist.barrier(group=groups.control)
    return out


def test_followers_stay_out_of_samples_and_weight_sync(tmp_path):
    results = spawn(_worker, 3, tmp_path)
    for rank, out in enumerate(results):
        assert out[1]["samples_ranks"] == out[1]["weight_sync_ranks"] == (0, 1, 2)
        assert out[1]["seen"] == [0, 1, 2] and out[1]["payload"] == "weights from 0"
        assert out[2]["samples_ranks"] == out[2]["weight_sync_ranks"] == (0, 1)
        if rank == 2:
            assert out[2]["member"] == (False, False)
            assert out[2]["seen"] is None and out[2]["payload"] == "weights from 2"
        else:
            assert out[2]["member"] == (True, True)
            assert out[2]["seen"] == [0, 1] and out[2]["payload"] == "weights from 0"
