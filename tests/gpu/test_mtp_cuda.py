"""On a CUDA device, one rank: a train step with multi-token prediction (--mtp-num-layers).

Contracts (`tests/distributed/test_mtp.py`'s micro-batches and loss, N = 2, F = 0.3), a tiny
DeepSeek-V3 whose checkpoint carries both MTP layers (multi-latent attention and MoE in them),
so every weight comes from the checkpoint (freshly initialised MTP layers would differ between
the CPU's and the GPU's random generators: a first version of this test compared those):
- fp32 with TF32 off: every gradient (main and MTP parameters) and `actor/mtp_loss` equal
  those of the same step on the CPU (gloo, a spawned rank) within 1e-5: the MTP targets, masks
  and metric reductions live on the model's device;
- bf16: the step runs, the MTP loss is finite and within 0.05 of the CPU fp32 one.
Marked `gpu`, skipped without one. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.mtp import FACTOR, NUM_MTP, mtp_micro_batches, mtp_step, reference_worker
from tests.harness.ranks import spawn

pytestmark = pytest.mark.gpu


def _cuda_role(path: str, extra: dict):
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = {**role_args(path), "lr": 1e-3, "clip_grad": 0.0, **extra}
    args.update(mtp_num_layers=NUM_MTP, mtp_loss_scaling_factor=FACTOR)
    par = Parallelism.from_megatron_args(args)
    layout = plan_layout(1, [RoleGroupSpec(["train"], num_ranks=1)], {"train": par})
    platform = detect_platform("cuda", "nccl")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    return role


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mtp_step_on_cuda(tiny_model, tmp_path, precision):
    import torch.distributed as dist

    from megatron_async_rl.distributed.platform import (
        detect_platform,
        exact_fp32_matmuls,
        init_distributed,
    )

    family = "deepseek_v3"
    path = str(tiny_model(family, num_mtp_layers=NUM_MTP))
    (tmp_path / "cpu").mkdir()
    cpu = spawn(reference_worker, 1, tmp_path / "cpu", path)[0]
    exact_fp32_matmuls()
    init_distributed(detect_platform("cuda", "nccl"), init_method=f"file://{tmp_path}/rdv",
                     rank=0, world_size=1)  # fmt: skip
    try:
        role = _cuda_role(path, {"bf16": True} if precision == "bf16" else {})
        assert next(role.chunks[0].mtp.parameters()).is_cuda
        metrics, _, grads = mtp_step(role, mtp_micro_batches())
    finally:
        dist.destroy_process_group()
    got, want = metrics["actor/mtp_loss"], cpu["metrics"]["actor/mtp_loss"]
    print(f"{family} {precision} MTP on CUDA: actor/mtp_loss {got:.6f} vs CPU {want:.6f}")
    if precision == "fp32":
        assert got == pytest.approx(want, abs=1e-5)
        for name, grad in cpu["grads"].items():
            torch.testing.assert_close(grads[name].cpu(), grad, rtol=1e-4, atol=1e-5, msg=name)
    else:
        assert torch.isfinite(torch.tensor(got)) and abs(got - want) < 0.05
