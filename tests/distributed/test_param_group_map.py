"""--dump-param-to-param-group-map: the train role writes Megatron-LM's map of its optimizer.

Contract: a train role built with the flag (tiny Qwen3-MoE on 4 gloo ranks: pp=2, ep=2, dp=2 for
the dense layers; the distributed optimizer, so each rank's optimizer holds only its shard;
--decoupled-lr) writes, while it builds its optimizer, a torch.distributed.checkpoint directory
at the flag's path, which (1) equals the one megatron-core 0.16.1's own writer
(`get_megatron_optimizer(dump_param_to_param_group_map=...)`) makes for the same model chunks
once its global parallel state is initialised on the same ranks (name for name, group index for
group index: global layer and expert indices, dense groups before expert ones); (2) names every
trainable parameter of every rank; and (3) matches the optimizer's actual groups: each
parameter's group has wd_mult 0 exactly for biases and 1-D parameters, max_lr --decoupled-lr
exactly for the embedding and output layer, and is expert-parallel exactly for the experts.
A train role whose window does not start at rank 0 (world [generate x1, train x1], megatron-core's
plain fp32 optimizer) writes the same kind of map over its own ranks alone: every trainable
parameter, in a group with the attributes above. Nothing is faked: real megatron-core, real DCP
files read back with torch's own converter.
"""

import pytest
import torch

from tests.harness.ranks import spawn

LR, DECOUPLED_LR = 1e-5, 3e-5


def _worker(rank, world_size, tmp_dir, path):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_async_rl.config.megatron import core_kwargs
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from megatron_async_rl.roles.param_groups import global_param_names
    from tests.harness.roles import role_args

    args = role_args(path, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    args.update(lr=LR, decoupled_lr=DECOUPLED_LR, use_distributed_optimizer=True,
                dump_param_to_param_group_map=f"{tmp_dir}/ours")  # fmt: skip
    par = Parallelism.from_megatron_args(args)
    layout = plan_layout(world_size, [RoleGroupSpec(["train"], num_ranks=world_size)],
                         {"train": par})  # fmt: skip
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)

    # The reference: megatron-core's own writer, over its global state on the same ranks (the
    # world is the train role here, in the same default order), for the same model chunks.
    parallel_state.destroy_global_memory_buffer()  # the platform made it; init makes it again
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, expert_model_parallel_size=2
    )
    kwargs = core_kwargs.optimizer_config_kwargs(args)
    kwargs.update(use_distributed_optimizer=False, bf16=False)  # the groups do not depend on it
    get_megatron_optimizer(
        OptimizerConfig(**kwargs), role.models, use_gloo_process_groups=False,
        dump_param_to_param_group_map=f"{tmp_dir}/megatron_core",
    )  # fmt: skip
    parallel_state.destroy_model_parallel()
    dist.barrier()

    names = global_param_names(role.models, role.config.num_moe_experts, role.pgc.ep)
    params = {
        names[p]: {
            "wd0": p.ndim == 1 or names[p].endswith(".bias"),
            "decoupled": bool(getattr(p, "is_embedding_or_output_parameter", False)),
            "expert": not getattr(p, "allreduce", True),
        }
        for chunk in role.models
        for p in chunk.parameters()
        if p.requires_grad
    }
    groups_seen = [
        {"wd_mult": g["wd_mult"], "max_lr": g["max_lr"], "expert": g["is_expert_parallel"]}
        for g in role.optimizer.param_groups
    ]
    return {"params": params, "groups": groups_seen}


def _offset_worker(rank, world_size, tmp_dir, path, extra):
    """World [generate (rank 0, builds the groups only), train (rank 1)], the role's args with
    `extra`."""
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = role_args(path)
    args.update(lr=LR, decoupled_lr=DECOUPLED_LR, dump_param_to_param_group_map=f"{tmp_dir}/map")
    args.update(extra)
    specs = [RoleGroupSpec(["generate"], num_ranks=1), RoleGroupSpec(["train"], num_ranks=1)]
    layout = plan_layout(world_size, specs, {"train": Parallelism(1, 1)})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    out = None
    if rank == 1:
        role = MegatronRole("train", args, Parallelism(1, 1), groups.roles["train"], platform, 5)
        out = {
            "names": {n for n, p in role.models[0].named_parameters() if p.requires_grad},
            "decoupled": {n for n, p in role.models[0].named_parameters()
                          if getattr(p, "is_embedding_or_output_parameter", False)},
            "wd0": {n for n, p in role.models[0].named_parameters() if p.ndim == 1},
            "groups": [(g["wd_mult"], g["max_lr"]) for g in role.optimizer.param_groups],
            "sharded": all(type(p).__name__ == "DTensor" for p in role.models[0].parameters()),
        }  # fmt: skip
    dist.barrier(group=groups.control)
    return out


def _read(directory) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = f"{directory}.pt"
    dcp_to_torch_save(str(directory), out)
    return torch.load(out, weights_only=False)


def test_train_role_writes_megatron_lm_param_group_map(tiny_model, tmp_path):
    results = spawn(_worker, 4, tmp_path, str(tiny_model("qwen3_moe")))

    ours, reference = _read(tmp_path / "ours"), _read(tmp_path / "megatron_core")
    assert ours == reference
    params = {name: info for r in results for name, info in r["params"].items()}
    assert set(ours) == set(params)
    assert {n for n in ours if ".decoder.layers.1." in n}  # stage 1's local layer 0
    assert {f"local_experts.{e}." for e in range(4)} <= {
        n[n.index("local_experts.") :].split("linear")[0] for n in ours if "local_experts." in n
    }
    groups = results[0]["groups"]
    assert all(r["groups"] == groups for r in results)  # megatron-core aligns them
    kinds = set()
    for name, index in ours.items():
        info, group = params[name], groups[index]
        assert (group["wd_mult"] == 0.0) == info["wd0"], name
        assert group["max_lr"] == (DECOUPLED_LR if info["decoupled"] else LR), name
        assert group["expert"] == info["expert"], name
        kinds.add((info["wd0"], info["decoupled"], info["expert"]))
    assert len(kinds) >= 4  # default, no weight decay, decoupled lr, experts
    assert sorted(set(ours.values())) == list(range(len(set(ours.values()))))


@pytest.mark.parametrize("wrapper", ["ddp", "torch_fsdp2"])
def test_a_train_window_after_rank_0_writes_the_map_alone(tiny_model, tmp_path, wrapper):
    """Also under --use-torch-fsdp2, whose DTensor parameters keep megatron-core's attributes
    (the decoupled lr of the embedding and output layer)."""
    fsdp2 = wrapper == "torch_fsdp2"
    extra = {"use_torch_fsdp2": True, "gradient_accumulation_fusion": False} if fsdp2 else {}
    results = spawn(_offset_worker, 2, tmp_path, str(tiny_model("llama")), extra)
    mine = results[1]
    written = _read(tmp_path / "map")
    assert set(written) == mine["names"]
    for name, index in written.items():
        wd_mult, max_lr = mine["groups"][index]
        assert (wd_mult == 0.0) == (name in mine["wd0"] or name.endswith(".bias")), name
        assert max_lr == (DECOUPLED_LR if name in mine["decoupled"] else LR), name
    assert len(mine["decoupled"]) == 2  # the embedding and the output layer (untied)
    assert mine["sharded"] == fsdp2
