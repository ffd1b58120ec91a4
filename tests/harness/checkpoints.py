"""A train role through a Megatron checkpoint inside a rank: save after one step, load in a new
world, take the second step. `tests/distributed/test_checkpoint_megatron.py` states the
contracts; `test_rank_order_groups.py` loads the same checkpoint in another rank order.
"""

from __future__ import annotations

from tests.harness.roles import role_args
from tests.harness.train_steps import batch


def checkpoint_role(world_size, path, parallel):
    """A train role over the whole world with `parallel`, the distributed optimizer and a cosine
    lr decay over 4 steps (a different lr at every step), loaded from `path`."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    args = role_args(path, **parallel)
    args.update(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=True)
    args.update(lr_decay_style="cosine", train_iters=4)  # a different lr at every step
    par = Parallelism.from_megatron_args(args)
    layout = plan_layout(
        world_size, [RoleGroupSpec(["train"], num_ranks=world_size)], {"train": par}
    )
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    return role


def checkpoint_step(role, seed):
    """One `train_step` on `batch()` (tokens rolled by `seed`) as one micro-batch."""
    tokens, mask = batch()
    tokens = tokens.roll(seed, dims=1)
    total = mask.sum()

    def loss_fn(logp, entropy, batch):
        loss = -(logp * batch["mask"]).sum() / total
        return loss, {"loss": loss.detach()}

    return role.train_step([{"tokens": tokens, "mask": mask}], loss_fn)


def lr_schedule(role):
    """The scheduler's step count and every param group's lr (the next step's)."""
    return role.lr_scheduler.num_steps, [g["lr"] for g in role.optimizer.param_groups]


def exported_weights(role):
    """The exported HF state dict, cloned (None on a rank that exports nothing)."""
    out = role.gather_hf_state_dict()
    return None if out is None else {k: v.detach().clone() for k, v in out.items()}


def save_worker(rank, world_size, tmp_dir, path, ckpt):
    """TP=2: a step, `save_train_state` to `ckpt`, a second step. Returns (weights at the save,
    weights after the second step, (schedule at the save, the second step's lr))."""
    from pathlib import Path

    from megatron_async_rl.checkpoint.megatron_state import save_train_state

    role = checkpoint_role(world_size, path, {"tensor_model_parallel_size": 2})
    checkpoint_step(role, 0)
    save_train_state(role, Path(ckpt))
    saved, schedule = exported_weights(role), lr_schedule(role)
    lr = checkpoint_step(role, 1)["actor/lr"]
    return saved, exported_weights(role), (schedule, lr)


def load_worker(rank, world_size, tmp_dir, path, ckpt, parallel):
    """`parallel`: `load_train_state` from `ckpt`, then the second step. Returns (loaded weights,
    weights after the step, (loaded schedule, the step's lr))."""
    from pathlib import Path

    from megatron_async_rl.checkpoint.megatron_state import load_train_state

    role = checkpoint_role(world_size, path, parallel)
    load_train_state(role, Path(ckpt))
    loaded, schedule = exported_weights(role), lr_schedule(role)
    lr = checkpoint_step(role, 1)["actor/lr"]
    return loaded, exported_weights(role), (schedule, lr)
