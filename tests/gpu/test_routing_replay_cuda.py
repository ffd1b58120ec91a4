"""On a CUDA device, one rank: MoE routing replay in a real Megatron role on the GPU.

Contracts: `tests/distributed/test_routing_replay.py`'s checks (`replay_checks`,
`check_results`) with a tiny Qwen3-MoE train role on the GPU, NCCL and full activation
recompute, in fp32 (TF32 off) and bf16: replaying a recorded routing gives the recording pass's
log-probs exactly; perturbed routers disagree with the recording on some tokens and a replaying
pass uses the recorded experts on every token; an optimizer step replays (its forward log-probs
equal the replaying forward-only pass; bf16 within 2e-2) and its recomputed forwards consume
every replayed micro-batch. The replay indices are moved to the router's device by
`moe.replay`; nothing here moves them. Marked `gpu`, skipped without one. Nothing is faked.
"""

from __future__ import annotations

import pytest

from tests.harness.roles import role_args
from tests.harness.routing import RECOMPUTE, check_results, replay_checks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_routing_replay_on_cuda(tiny_model, tmp_path, precision):
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import (
        detect_platform,
        exact_fp32_matmuls,
        init_distributed,
    )
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    exact_fp32_matmuls()
    path = str(tiny_model("qwen3_moe"))
    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        args = {**role_args(path, bf16=precision == "bf16"), **RECOMPUTE}
        layout = plan_layout(1, [RoleGroupSpec(["train"], num_ranks=1)],
                             {"train": Parallelism(1, 1)})  # fmt: skip
        groups = build_world_groups(layout, platform.backend)
        role = MegatronRole("train", args, Parallelism(1, 1), groups.roles["train"], platform,
                            seed=5, routing=True)  # fmt: skip
        role.load_hf_checkpoint(path)
        result = replay_checks(role, "train")
        atol = 1e-5 if precision == "fp32" else 2e-2
        assert check_results([result], f"cuda-{precision}", atol=atol) == {"train"}
        print(f"routing replay on CUDA {precision}: "
              f"(own matched, used matched, tokens) per layer after perturbation "
              f"{result['counts_perturbed']}")
    finally:
        dist.destroy_process_group()
