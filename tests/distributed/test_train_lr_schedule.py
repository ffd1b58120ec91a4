"""The train role's optimizer follows its lr schedule, one scheduler step per optimizer step.

Contract: a real `MegatronRole` (megatron-core's distributed optimizer, DP=2 on gloo ranks) with
--lr-warmup-iters 4 and a cosine decay over --train-iters 10 takes two `train_step`s; each
reports as `actor/lr` and `actor/wd` the lr and weight decay that megatron-core's
`OptimizerParamScheduler`, driven alone over a dummy optimizer with the same arguments, gives
for that step (before it advances), and afterwards every param group of the role's optimizer
has the scheduler's lr for the next step and its weight decay times the group's wd_mult.
With --ddp-num-buckets 3 the DDP bucket size is the role's parameter count over 3, and the
schedule gets the optimizer's loss scale and (with --overlap-grad-reduce) DDP's no_sync and
grad-sync hooks, as in Megatron-LM. Nothing is faked in the role; the reference scheduler's
optimizer is a plain `torch.optim.SGD`.
"""

import pytest

from tests.harness.ranks import spawn
from tests.harness.train_steps import batch

SCHEDULE = {"lr_warmup_iters": 4, "lr_decay_style": "cosine", "train_iters": 10}


def _worker(rank, world_size, tmp_dir, path):
    import torch

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = role_args(path)
    args.update(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=True, weight_decay=0.1)
    args.update(SCHEDULE)
    # Megatron-LM's bucket count: bucket_size = params / 3 (DDP keeps it with overlap only)
    args.update(ddp_num_buckets=3, overlap_grad_reduce=True)
    par = Parallelism.from_megatron_args(args)
    layout = plan_layout(world_size, [RoleGroupSpec(["train"], num_ranks=world_size)],
                         {"train": par})  # fmt: skip
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    tokens, mask = batch()
    rows = torch.arange(4).chunk(world_size)[rank].tolist()
    micro = [{"tokens": tokens[r : r + 1], "mask": mask[r : r + 1]} for r in rows]

    def loss_fn(logp, entropy, batch):
        loss = -(logp * batch["mask"]).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    reported = [role.train_step(micro, loss_fn) for _ in range(2)]
    param_groups = [
        (g["lr"], g["weight_decay"], g.get("wd_mult", 1.0)) for g in role.optimizer.param_groups
    ]
    return {
        "args": args,
        "reported": [(m["actor/lr"], m["actor/wd"], m["actor/update_ok"]) for m in reported],
        "param_groups": param_groups,
        "num_steps": role.lr_scheduler.num_steps,
        "bucket_size": role.model.ddp_config.bucket_size,
        "numel": sum(p.numel() for p in role.module.parameters()),
        "wired": (  # as Megatron-LM's train(): loss scale and DDP sync hooks in the schedule
            role.config.grad_scale_func == role.optimizer.scale_loss,
            role.config.no_sync_func == role.model.no_sync,
            role.config.grad_sync_func == role.model.start_grad_sync,
        ),
    }


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model("llama"))


def test_train_steps_follow_the_schedule_driven_alone(tiny_path, tmp_path):
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_async_rl.roles.lr_schedule import schedule_kwargs

    results = spawn(_worker, 2, tmp_path, tiny_path)
    kwargs = schedule_kwargs(results[0]["args"], None)
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    alone = OptimizerParamScheduler(dummy, **kwargs)
    expected = []
    for _ in range(2):
        expected.append((dummy.param_groups[0]["lr"], alone.get_wd(), 1.0))
        alone.step(increment=1)
    next_lr, next_wd = dummy.param_groups[0]["lr"], alone.get_wd()
    assert [e[0] for e in expected] == [0.0, 1e-3 / 4]  # warm-up from 0: the first update's lr
    for rank, result in enumerate(results):
        assert result["reported"] == expected, rank
        assert result["num_steps"] == 2
        assert result["bucket_size"] == result["numel"] // 3
        assert result["wired"] == (True, True, True)
        assert len(result["param_groups"]) >= 2  # with and without weight decay
        for lr, weight_decay, wd_mult in result["param_groups"]:
            assert lr == next_lr and weight_decay == next_wd * wd_mult, (rank, lr, weight_decay)
