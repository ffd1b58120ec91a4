"""On a CUDA device, one rank: an RL step's PPO mini-batch steps on the GPU, dense and MoE.

Contracts: `tests/distributed/test_minibatch_step.py`'s worker (`tests/harness/minibatch.py`)
with its role on the GPU and NCCL (`roles.learn.train_on_batch`, B = 8 samples,
--global-batch-size 4: two optimizer steps):
- fp32 with TF32 off (`platform.exact_fp32_matmuls`): the weights match the hand-written
  reference (`transformers` + torch Adam, on the CPU) within 1e-5 and the loss within 1e-5;
- bf16 (`--bf16`, the mixed-precision optimizer): both steps run, the loss is within 0.02 of the
  reference's, every weight is finite and some moved;
- a qwen3_moe role in bf16 (MoE router and experts on CUDA, without Transformer Engine): the same;
- a deepseek_v3 role in bf16 (multi-latent attention, shared experts, the routers' expert bias
  updated over the role's groups at each step: `compat.megatron_fixes`): the same;
- bf16 with the flags a cluster run sets and CPU runs cannot exercise: the distributed
  optimizer, --overlap-grad-reduce, --overlap-param-gather, full activation recompute: the same.
Marked `gpu`, skipped without one. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.minibatch import (
    MODES,
    minibatch_data,
    minibatch_reference,
    minibatch_worker,
)

pytestmark = pytest.mark.gpu


CLUSTER_FLAGS = {
    "use_distributed_optimizer": True, "overlap_grad_reduce": True,
    "overlap_param_gather": True, "recompute_granularity": "full",
    "recompute_method": "uniform", "recompute_num_layers": 1,
}  # fmt: skip


CASES = {
    "llama-fp32": ("llama", "fp32", None),
    "llama-bf16": ("llama", "bf16", None),
    "moe-bf16": ("qwen3_moe", "bf16", None),
    "deepseek-bf16": ("deepseek_v3", "bf16", None),
    "llama-bf16-cluster": ("llama", "bf16", CLUSTER_FLAGS),
}


@pytest.mark.parametrize(("family", "precision", "extra"), CASES.values(), ids=CASES.keys())
def test_minibatch_steps_on_cuda(tiny_model, tmp_path, family, precision, extra):
    import torch.distributed as dist

    from megatron_async_rl.distributed.platform import (
        detect_platform,
        exact_fp32_matmuls,
        init_distributed,
    )
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    exact_fp32_matmuls()
    path = str(tiny_model(family))
    data = minibatch_data(path)
    start = load_hf_state_dict(path)
    init_distributed(detect_platform("cuda", "nccl"), init_method=f"file://{tmp_path}/rdv",
                     rank=0, world_size=1)  # fmt: skip
    try:
        got = minibatch_worker(0, 1, str(tmp_path), path, data, 2, device="cuda",
                      bf16=precision == "bf16", extra=extra)  # fmt: skip
    finally:
        dist.destroy_process_group()
    for mode in MODES:
        weights, loss, _ = minibatch_reference(path, data, mode)
        result = got[mode]
        assert result["metrics"]["actor/optimizer_steps"] == 2.0
        new = {k: v.float().cpu() for k, v in result["weights"].items()}
        assert all(torch.isfinite(t).all() for t in new.values()), (family, precision, mode)
        assert any(not new[k].equal(start[k].float()) for k in start), (family, precision, mode)
        got_loss = result["metrics"]["actor/loss"]
        print(f"{family} {precision} {mode}: loss {got_loss:.6f} vs reference {loss:.6f}")
        if precision == "fp32":
            assert got_loss == pytest.approx(loss, rel=1e-5, abs=1e-6), mode
            for key, tensor in new.items():
                diff = (tensor - weights[key]).abs().max().item()
                assert diff <= 1e-5, f"{mode} {key}: max abs diff {diff} on CUDA vs the reference"
        else:
            assert abs(got_loss - loss) <= 0.02, (family, mode, got_loss, loss)
