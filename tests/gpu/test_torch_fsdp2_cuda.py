"""On a CUDA device, one rank: --use-torch-fsdp2 as megatron-core builds it there (its own CUDA
device mesh, NCCL), no CPU compatibility layer.

Contracts, fp32 with TF32 off, a tiny Llama with untied embeddings: the export right after the
HF load is the checkpoint, byte for byte; two optimizer steps (clipping on) give DDP's weights
within 1e-5 and its grad norms; a checkpoint saved under FSDP2 loads back into a fresh FSDP2
role bit for bit. Marked `gpu`, skipped without one. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.roles import role_args
from tests.harness.train_steps import FSDP2, TRAIN, seeded_step

pytestmark = pytest.mark.gpu


def test_fsdp2_on_cuda(tiny_model, tmp_path):
    import torch.distributed as dist

    from megatron_async_rl.checkpoint.megatron_state import load_train_state, save_train_state
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import (
        detect_platform,
        exact_fp32_matmuls,
        init_distributed,
    )
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    exact_fp32_matmuls()
    path = str(tiny_model("llama", tie_word_embeddings=False))
    original = load_hf_state_dict(path)
    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        layout = plan_layout(1, [RoleGroupSpec(["train"], num_ranks=1)],
                             {"train": Parallelism(1, 1)})  # fmt: skip
        groups = build_world_groups(layout, platform.backend)

        def role(extra):
            args = {**role_args(path), **TRAIN, **extra}
            built = MegatronRole("train", args, Parallelism(1, 1), groups.roles["train"],
                                 platform, seed=5)  # fmt: skip
            built.load_hf_checkpoint(path)
            return built

        ddp = role({})
        ddp_norms = [seeded_step(ddp, seed)["actor/grad_norm"] for seed in (0, 1)]
        ddp_weights = ddp.gather_hf_state_dict()
        fsdp = role(FSDP2)
        assert type(fsdp.models[0]).__name__ == "TorchFullyShardedDataParallel"
        assert next(fsdp.chunks[0].parameters()).is_cuda
        loaded = fsdp.gather_hf_state_dict()
        assert all(torch.equal(loaded[k].cpu(), t) for k, t in original.items())
        norms = [seeded_step(fsdp, seed)["actor/grad_norm"] for seed in (0, 1)]
        assert norms == pytest.approx(ddp_norms, rel=1e-5)
        trained = fsdp.gather_hf_state_dict()
        diff = max((trained[k] - t).abs().max().item() for k, t in ddp_weights.items())
        print(f"FSDP2 on CUDA: grad norms {norms} vs DDP {ddp_norms}, weights max diff {diff:.2e}")
        assert diff <= 1e-5
        save_train_state(fsdp, tmp_path / "ckpt")
        again = role(FSDP2)
        load_train_state(again, tmp_path / "ckpt")
        reloaded = again.gather_hf_state_dict()
        assert all(torch.equal(reloaded[k], t) for k, t in trained.items())
    finally:
        dist.destroy_process_group()
