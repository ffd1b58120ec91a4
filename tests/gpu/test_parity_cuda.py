"""On a CUDA device, one rank: the Megatron model of each tiny family matches `transformers`.

Contract: logits within 1e-4 max abs (fp32) after HF import, with NCCL, no CPU compatibility
layer, and Transformer Engine layer specs when transformer_engine is importable. Skipped
without a GPU (marker `gpu`). Nothing is faked.
"""

import pytest
import torch

from tests.distributed.test_hf_parity import FAMILIES, TOLERANCE, _role_args, _tokens

pytestmark = pytest.mark.gpu


def test_single_rank_cuda_parity(tmp_path):
    import os

    import torch.distributed as dist
    import transformers

    from megatron_async_rl.config.schema import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform, init_distributed
    from megatron_async_rl.models.tiny import write_tiny_model
    from megatron_async_rl.roles.megatron_role import MegatronRole

    paths = {f: str(write_tiny_model(tmp_path / f, f, seed=3)) for f in FAMILIES}
    references = {}
    for family, path in paths.items():  # before any Megatron state exists in this process
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            references[family] = model.cuda()(_tokens(96).cuda()).logits.cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29655")
    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method="env://", rank=0, world_size=1)
    try:
        layout = plan_layout(1, [RoleGroupSpec(["ref"], num_ranks=1)], {"ref": Parallelism(1, 1)})
        groups = build_world_groups(layout, platform.backend)
        for family, path in paths.items():
            role = MegatronRole("ref", _role_args(path), Parallelism(1, 1), groups.roles["ref"],
                                platform, seed=5)  # fmt: skip
            role.load_hf_checkpoint(path)
            logits = role.full_logits(_tokens(role.spec.vocab_size).cuda(), micro_batch_size=4)
            diff = (logits.cpu() - references[family]).abs().max().item()
            assert diff <= TOLERANCE, f"{family} on CUDA: max abs diff {diff}"
    finally:
        dist.destroy_process_group()
