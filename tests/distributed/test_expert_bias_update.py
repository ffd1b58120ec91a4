"""The MoE routers' expert bias (--moe-router-enable-expert-bias, DeepSeek-V3's aux-loss-free
balancing) is updated at each optimizer step over the role's own groups.

Contract (real megatron-core, a tiny DeepSeek-V3 from its HF checkpoint, a train role on 2 gloo
ranks, data-parallel 2, each rank a different micro-batch): a train step runs (megatron-core
0.16.1 updates the bias over its global parallel state, uninitialised here: it raised at the
first step); every router's bias moves by exactly `--moe-router-bias-update-rate` times the sign
of its expert's deficit against the mean load, counted over BOTH data-parallel ranks' tokens
(recorded just before the update); both ranks hold the same bias afterwards; the per-step token
counts are zeroed. Nothing is faked: the recorder only reads the routers' counters.
"""

import torch

from tests.harness.ranks import spawn

RATE = 0.01


def _worker(rank, world_size, tmp_dir, path, padded=False):
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = {**role_args(path), "moe_router_bias_update_rate": RATE}
    assert args.get("moe_router_enable_expert_bias"), "the deepseek_v3 checkpoint sets it"
    layout = plan_layout(2, [RoleGroupSpec(["train"], num_ranks=2)], {"train": Parallelism(1, 1)})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, Parallelism(1, 1), groups.roles["train"], platform, 5)
    role.load_hf_checkpoint(path)
    routers = [m for m in role.module.modules() if getattr(m, "expert_bias", None) is not None]
    before = torch.stack([r.expert_bias.detach().clone() for r in routers])
    recorded = {}
    finalize = role.config.finalize_model_grads_func

    def recording_finalize(*a, **kw):
        recorded["tokens"] = torch.stack([r.local_tokens_per_expert.clone() for r in routers])
        return finalize(*a, **kw)

    role.config.finalize_model_grads_func = recording_finalize
    tokens = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(rank))
    micro = {"tokens": tokens}
    if padded:  # right-padded rows and their mask, as roles/learn.py passes them
        assert role.mask_moe_padding
        tokens[0, -3:], tokens[1, -5:] = 0, 0
        micro["padding"] = tokens == 0
    metrics = role.train_step([micro], lambda lp, ent, mb: (-lp.mean(), {}))
    after = torch.stack([r.expert_bias.detach().clone() for r in routers])
    gathered = [torch.empty_like(recorded["tokens"]) for _ in range(2)]
    dist.all_gather(gathered, recorded["tokens"])
    return {
        "rank": rank, "before": before, "after": after, "tokens": torch.stack(gathered),
        "zeroed": all(float(r.local_tokens_per_expert.abs().sum()) == 0 for r in routers),
        "update_ok": metrics["actor/update_ok"], "topk": role.config.moe_router_topk,
        "valid": int((tokens != 0).sum()),
    }  # fmt: skip


def test_expert_bias_moves_towards_the_mean_load_over_the_role(tiny_model, tmp_path):
    results = spawn(_worker, 2, tmp_path, str(tiny_model("deepseek_v3")))
    first, second = sorted(results, key=lambda r: r["rank"])
    assert first["update_ok"] == 1.0 and first["zeroed"] and second["zeroed"]
    assert first["before"].shape[0] >= 1  # at least one MoE layer
    tokens = first["tokens"].sum(dim=0)  # both data-parallel ranks' counts, per layer, expert
    assert float(first["tokens"][0].sum()) > 0 and float(first["tokens"][1].sum()) > 0
    assert not torch.equal(first["tokens"][0], first["tokens"][1])  # the ranks routed apart
    deficit = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1] - tokens
    expected = first["before"] + RATE * torch.sign(deficit)
    torch.testing.assert_close(first["after"], expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(second["after"], first["after"], rtol=0, atol=0)
    assert float((first["after"] - first["before"]).abs().sum()) > 0


def test_pads_are_not_counted_in_the_expert_load(tiny_model, tmp_path):
    """With the batch's padding mask (megatron-core 0.16.1 could not broadcast it against the
    routing map: `compat.megatron_fixes`), each layer counts top-k experts for every valid
    token of the step and none for pads, and the update still holds."""
    results = spawn(_worker, 2, tmp_path, str(tiny_model("deepseek_v3")), True)
    first, second = sorted(results, key=lambda r: r["rank"])
    assert first["update_ok"] == 1.0 and first["zeroed"]
    per_layer = first["tokens"].sum(dim=-1)  # [rank, layer]: experts chosen
    for rank, result in enumerate((first, second)):
        assert result["valid"] == 16  # 24 tokens, 3 + 5 pads
        assert (per_layer[rank] == result["valid"] * result["topk"]).all(), per_layer
    tokens = first["tokens"].sum(dim=0)
    deficit = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1] - tokens
    torch.testing.assert_close(first["after"], first["before"] + RATE * torch.sign(deficit),
                               rtol=0, atol=1e-7)  # fmt: skip
    torch.testing.assert_close(second["after"], first["after"], rtol=0, atol=0)
