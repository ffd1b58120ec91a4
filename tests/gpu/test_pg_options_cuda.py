"""On a CUDA device, one NCCL rank: a role's groups carry the options its group flags plan.

Contract: `distributed.groups._role_collection` over a one-rank grid, with a
--nccl-communicator-config-path file and --high-priority-stream-groups, gives NCCL process
groups whose `ProcessGroupNCCL.Options` hold the planned fields (max_ctas, min_ctas,
cga_cluster_size, is_high_priority_stream), and the groups reduce; with --use-sharp the `dp_cp`
group is made and initialised while NCCL_COLLNET_ENABLE=1, the variable is gone afterwards and
the group still reduces (NCCL falls back where the network has no SHARP). Marked `gpu`, skipped
without one; skipped, saying so, where torch does not expose a group's NCCL options. Nothing is
faked.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


def _collection(tmp_path, args):
    import torch.distributed as dist

    from megatron_async_rl.distributed import groups, pg_options
    from megatron_async_rl.distributed.layout import RoleGrid
    from megatron_async_rl.distributed.platform import detect_platform, init_distributed

    init_distributed(detect_platform("cuda", "nccl"), init_method=f"file://{tmp_path}/rdv",
                     rank=0, world_size=1)  # fmt: skip
    plan = pg_options.plan_group_options(args, dist.get_backend())
    grid = RoleGrid(offset=0, tp=1, pp=1, dp=1)
    return groups._role_collection(grid, "nccl", None, plan, torch.device("cuda", 0))


def _reduces(group) -> bool:
    import torch.distributed as dist

    value = torch.ones(1, device="cuda")
    dist.all_reduce(value, group=group)
    return value.item() == 1.0


def _options(group):
    backend = group._get_backend(torch.device("cuda"))
    options = getattr(backend, "options", None)
    if options is None:
        pytest.skip("this torch does not expose ProcessGroupNCCL.options")
    return options


def test_role_groups_carry_the_planned_nccl_options(tmp_path):
    import torch.distributed as dist

    config = tmp_path / "nccl.yaml"
    config.write_text("dp_cp: {max_ctas: 8, min_ctas: 2, cga_cluster_size: 2}\ntp: {max_ctas: 4}\n")
    args = {"nccl_communicator_config_path": str(config), "high_priority_stream_groups": ["tp"]}
    try:
        pgc = _collection(tmp_path, args)
        dp_cp, tp, pp = _options(pgc.dp_cp), _options(pgc.tp), _options(pgc.pp)
        assert (dp_cp.config.max_ctas, dp_cp.config.min_ctas) == (8, 2)
        assert dp_cp.config.cga_cluster_size == 2
        assert dp_cp.is_high_priority_stream is False
        assert tp.config.max_ctas == 4 and tp.is_high_priority_stream is True
        assert pp.is_high_priority_stream is False  # no options: NCCL's defaults
        assert all(_reduces(g) for g in (pgc.dp_cp, pgc.tp, pgc.pp))
    finally:
        dist.destroy_process_group()


def test_sharp_is_asked_for_dp_cp_only(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.delenv("NCCL_COLLNET_ENABLE", raising=False)
    try:
        pgc = _collection(tmp_path, {"use_sharp": True})
        assert "NCCL_COLLNET_ENABLE" not in os.environ
        assert _reduces(pgc.dp_cp) and _reduces(pgc.tp)
    finally:
        dist.destroy_process_group()
