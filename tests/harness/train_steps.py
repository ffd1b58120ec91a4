"""Train steps inside a rank, shared by the train-step, virtual-pipeline, FSDP2 and GPU tests:
one batch, a one-step worker, a seeded step on a built role, and the FSDP2 and optimizer flags
those tests train with.
"""

from __future__ import annotations

import torch

from tests.harness.roles import role_args

FSDP2 = {"use_torch_fsdp2": True, "gradient_accumulation_fusion": False}
"""--use-torch-fsdp2 (megatron-core's FSDP2 wrapper needs no gradient-accumulation fusion)."""
TRAIN = {"lr": 1e-3, "clip_grad": 0.5}
"""The FSDP2 tests' optimizer: gradient clipping on (their grad norms exceed 0.5)."""


def batch():
    """4 x 12 tokens (seed 4) and their response mask: 6 response tokens, row 1 ragged."""
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 96, (4, 12), generator=generator)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1.0
    mask[1, 9:] = 0.0  # ragged response lengths
    return tokens, mask


def train_step_worker(rank, world_size, tmp_dir, path, parallel):
    """One Adam step (lr 1e-3, no clipping) of a train role over the whole world with `parallel`,
    loss normalised over the step's token count, each DP rank on its share of `batch()`: the
    exported weights and the step's metrics."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    args = role_args(path, **parallel)
    args.update(lr=1e-3, clip_grad=0.0)
    par = Parallelism.from_megatron_args(args)
    groups_spec = [RoleGroupSpec(["train"], num_ranks=world_size)]
    layout = plan_layout(world_size, groups_spec, {"train": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    tokens, mask = batch()
    total_tokens = mask.sum()
    dp_rank = torch.distributed.get_rank(role.pgc.dp)
    dp_size = torch.distributed.get_world_size(role.pgc.dp)
    rows = torch.arange(4).chunk(dp_size)[dp_rank]
    micro = [{"tokens": tokens[r : r + 1], "mask": mask[r : r + 1]} for r in rows.tolist()]

    def loss_fn(logp, entropy, batch):
        loss = -(logp * batch["mask"]).sum() / total_tokens
        return loss, {"loss": loss.detach()}

    metrics = role.train_step(micro, loss_fn)
    return {"weights": role.gather_hf_state_dict(), "metrics": metrics}


def seeded_step(role, seed):
    """One `train_step` on `batch()` with its tokens rolled by `seed`, as two micro-batches of 2
    rows, loss normalised over the whole step: the step's metrics."""
    tokens, mask = batch()
    tokens, total = tokens.roll(seed, dims=1), mask.sum()

    def loss_fn(logp, entropy, batch):
        loss = -(logp * batch["mask"]).sum() / total
        return loss, {"loss": loss.detach()}

    micro = [{"tokens": tokens[r : r + 2], "mask": mask[r : r + 2]} for r in (0, 2)]
    return role.train_step(micro, loss_fn)
