"""On a CUDA device, one rank: `--cuda-graph-impl local` (the flag Megatron-LM's RL examples
pass) builds and runs, with the graph-safe RNG tracker seeded as Megatron-LM seeds it.

Contract: a train role built with megatron-core's per-layer CUDA graphs takes optimizer steps and
computes log-probs at two sequence lengths (RL batches are padded to their longest sample, so
the shape changes between steps); its log-probs and gradient norms equal those of the same role
without graphs (fp32, exact matmuls) within 1e-4. Marked `gpu`, skipped without one. Nothing is
faked.
"""

import pytest
import torch

from tests.distributed.test_hf_parity import _role_args

pytestmark = pytest.mark.gpu


def _run(path, platform, groups, graphs: bool) -> list[float]:
    from megatron_async_rl.distributed.layout import Parallelism
    from megatron_async_rl.roles.megatron_role import MegatronRole

    args = {**_role_args(path), "lr": 1e-4}
    if graphs:
        args["cuda_graph_impl"] = "local"
    role = MegatronRole("train", args, Parallelism(1, 1), groups.roles["train"], platform, 5)
    assert role.config.cuda_graph_impl == ("local" if graphs else "none")
    role.load_hf_checkpoint(path)
    out = []
    for step, seq_len in enumerate((12, 16, 12, 16)):
        tokens = torch.randint(0, 96, (4, seq_len), generator=torch.Generator().manual_seed(step))
        metrics = role.train_step(
            [{"tokens": tokens[:2]}, {"tokens": tokens[2:]}],
            lambda logp, entropy, mb: (-logp.mean() / 2, {}),
        )
        logp, _ = role.logprobs(tokens, micro_batch_size=2)
        out += [metrics["actor/grad_norm"], float(logp.double().sum())]
    return out


def test_local_cuda_graphs_train_and_score(tmp_path):
    import os

    import torch.distributed as dist

    from megatron_async_rl.config.schema import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import (
        detect_platform,
        exact_fp32_matmuls,
        init_distributed,
    )
    from megatron_async_rl.models.tiny import write_tiny_model

    exact_fp32_matmuls()
    path = str(write_tiny_model(tmp_path / "llama", "llama", seed=3))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29657")
    platform = detect_platform("cuda", "nccl")
    init_distributed(platform, init_method="env://", rank=0, world_size=1)
    try:
        layout = plan_layout(
            1, [RoleGroupSpec(["train"], num_ranks=1)], {"train": Parallelism(1, 1)}
        )
        groups = build_world_groups(layout, platform.backend)
        plain = _run(path, platform, groups, graphs=False)
        graphed = _run(path, platform, groups, graphs=True)
        print(f"cuda graphs local: plain {plain}\n  graphed {graphed}")
        for a, b in zip(plain, graphed):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (plain, graphed)
    finally:
        dist.destroy_process_group()
