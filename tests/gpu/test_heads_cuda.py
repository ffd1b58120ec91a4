"""On a CUDA device, one rank: the value and score heads (`models.heads`) on the GPU.

Contracts: `tests/harness/heads.py`'s `head_outputs` with a train role on the
GPU and NCCL, fp32 with TF32 off: per-token values match `AutoModelForTokenClassification` and
sequence scores `AutoModelForSequenceClassification` (references on the CPU, before any Megatron
state) within 1e-4; a value train step on the GPU gives a finite loss and head gradients.
Marked `gpu`, skipped without one. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.heads import TOLERANCE, head_outputs, hf_scores, hf_values
from tests.harness.roles import role_args

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_heads_on_cuda(tiny_model, tmp_path, family):
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import (
        detect_platform,
        exact_fp32_matmuls,
        init_distributed,
    )
    from megatron_async_rl.recipe.schema import RoleGroupSpec

    exact_fp32_matmuls()
    paths = {"value": str(tiny_model(family, task="token_classification")),
             "score": str(tiny_model(family, task="sequence_classification"))}  # fmt: skip
    values_ref, scores_ref = hf_values(paths["value"]), hf_scores(paths["score"])
    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        layout = plan_layout(1, [RoleGroupSpec(["train"], num_ranks=1)],
                             {"train": Parallelism(1, 1)})  # fmt: skip
        groups = build_world_groups(layout, platform.backend)
        out = head_outputs("train", role_args(paths["value"]), Parallelism(1, 1),
                            groups.roles["train"], platform, paths)  # fmt: skip
        values_diff = (out["values"].cpu() - values_ref).abs().max().item()
        scores_diff = (out["scores"].cpu() - scores_ref).abs().max().item()
        print(f"{family} heads on CUDA: values {values_diff:.2e}, scores {scores_diff:.2e}, "
              f"value step {out['step']['metrics']}")
        assert values_diff <= TOLERANCE and scores_diff <= TOLERANCE
        assert torch.isfinite(out["step"]["weight_grad"]).all()
        assert out["step"]["weight_grad"].abs().sum() > 0
    finally:
        dist.destroy_process_group()
