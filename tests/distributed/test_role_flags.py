"""Megatron-LM flags a role applies itself: the JIT fuser, fp16 logits.

Contract (real megatron-core on 2 gloo ranks; train on rank 0, logp on rank 1, so the world is
carved as in a run):
- `--disable-jit-fuser`: TorchDynamo is off in that process afterwards.
- `--fp16-lm-cross-entropy`: the role computes log-probs from bf16 logits without the fp32 copy;
  they differ from the fp32 computation by bf16 rounding only.
"""

import torch

from tests.harness.ranks import spawn


def _worker(rank, world_size, tmp_dir, path):
    import torch._dynamo

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = {
        "train": {**role_args(path), "disable_jit_fuser": True},
        "logp": {**role_args(path), "bf16": True, "fp16_lm_cross_entropy": True},
    }  # fmt: skip
    specs = [RoleGroupSpec(["train"], num_ranks=1), RoleGroupSpec(["logp"], num_ranks=1)]
    layout = plan_layout(2, specs, {r: Parallelism(1, 1) for r in args})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    name = layout.roles_of_rank(rank)[0]
    role = MegatronRole(name, args[name], Parallelism(1, 1), groups.roles[name], platform, 5)
    role.load_hf_checkpoint(path)
    out = {"role": name, "dynamo_disabled": torch._dynamo.config.disable}
    if name == "logp":
        tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
        logp, _ = role.logprobs(tokens, micro_batch_size=2)
        role.logprobs_in_fp32 = True
        reference, _ = role.logprobs(tokens, micro_batch_size=2)
        out["logp"], out["reference"] = logp, reference
    torch.distributed.barrier()
    return out


def test_role_level_megatron_flags(tiny_model, tmp_path):
    results = {r["role"]: r for r in spawn(_worker, 2, tmp_path, str(tiny_model("llama")))}
    train, logp = results["train"], results["logp"]
    assert train["dynamo_disabled"] and not logp["dynamo_disabled"]
    assert logp["logp"].dtype == torch.float32
    diff = (logp["logp"] - logp["reference"]).abs().max().item()
    assert 0 < diff < 0.1, diff  # bf16 arithmetic, not fp32, and not garbage
