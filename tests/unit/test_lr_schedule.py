"""The train role's lr and weight-decay schedule (`roles.lr_schedule`), counted in optimizer steps.

Contract: `schedule_kwargs` applies Megatron-LM's rules (decay steps from --lr-decay-iters, else
--train-iters, else the run's total optimizer steps, else a constant lr; warm-up from
--lr-warmup-fraction x decay steps, else --lr-warmup-iters; weight decay from --start/--end-weight
-decay, defaulting to --weight-decay, over --train-iters; sample flags divided by
--global-batch-size) and rejects, with a ConfigError naming the flag, every setting megatron-core's
`OptimizerParamScheduler` would assert on or misread. `build_lr_scheduler` drives megatron-core's
real scheduler over a plain `torch.optim.SGD` (nothing faked but the optimizer, which megatron-core
only reads `param_groups` of): its lr sequence equals the warm-up + cosine formula written out here,
each param group follows its own `max_lr` and `wd_mult`. `load_scheduler_state` restores the step
count, applies --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler, and starts a
checkpoint without a schedule at step 0.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megatron_async_rl.config import errors
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.roles import lr_schedule
from megatron_async_rl.roles.lr_schedule import (
    build_lr_scheduler,
    current_lr_and_wd,
    load_scheduler_state,
    schedule_kwargs,
)

LR, MIN_LR = 1e-3, 1e-5


def _args(**overrides):
    # Megatron-LM's defaults for the schedule's dests, as the flag table resolves them.
    args = {
        "lr": LR, "min_lr": 0.0, "lr_decay_style": "linear", "lr_decay_iters": None,
        "lr_warmup_iters": 0, "lr_warmup_fraction": None, "lr_warmup_init": 0.0,
        "lr_wsd_decay_style": "exponential", "lr_wsd_decay_iters": None, "weight_decay": 0.01,
        "start_weight_decay": None, "end_weight_decay": None,
        "weight_decay_incr_style": "constant", "train_iters": None,
        "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
        "lr_decay_samples": None, "lr_warmup_samples": 0, "lr_wsd_decay_samples": None,
        "train_samples": None, "global_batch_size": None,
    }  # fmt: skip
    args.update(overrides)
    return args


# ----------------------------------------------------------------------------------------------
# schedule_kwargs: the rules


@pytest.mark.parametrize(
    ("overrides", "total", "decay", "wd_incr"),
    [
        ({"lr_decay_iters": 50, "train_iters": 80}, 100, 50, 80),
        ({"train_iters": 80}, 100, 80, 80),
        ({}, 100, 100, 100),
        ({"lr_decay_iters": 50}, None, 50, 50),
    ],
)  # fmt: skip
def test_decay_steps_come_from_decay_iters_then_train_iters_then_the_total(
    overrides, total, decay, wd_incr
):
    kwargs = schedule_kwargs(_args(lr_decay_style="cosine", **overrides), total)
    assert kwargs["lr_decay_steps"] == decay and kwargs["wd_incr_steps"] == wd_incr
    assert kwargs["lr_decay_style"] == "cosine"


def test_the_full_set_of_constructor_arguments():
    kwargs = schedule_kwargs(
        _args(lr_warmup_iters=3, lr_warmup_init=1e-4, min_lr=MIN_LR, train_iters=20), None
    )
    assert kwargs == {
        "init_lr": 1e-4, "max_lr": LR, "min_lr": MIN_LR, "lr_warmup_steps": 3,
        "lr_decay_steps": 20, "lr_decay_style": "linear", "start_wd": 0.01, "end_wd": 0.01,
        "wd_incr_steps": 20, "wd_incr_style": "constant",
        "use_checkpoint_opt_param_scheduler": False, "override_opt_param_scheduler": False,
        "wsd_decay_steps": None, "lr_wsd_decay_style": "exponential",
    }  # fmt: skip


def test_without_a_horizon_the_lr_is_constant_after_the_warm_up(caplog):
    errors.warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=lr_schedule.__name__):
        kwargs = schedule_kwargs(_args(lr_decay_style="cosine", lr_warmup_iters=5), None)
    assert kwargs["lr_decay_style"] == "constant" and kwargs["lr_warmup_steps"] == 5
    assert kwargs["lr_decay_steps"] > 5
    assert "--lr-decay-style cosine is ignored" in caplog.text
    caplog.clear()
    schedule_kwargs(_args(lr_decay_style="constant"), None)
    assert caplog.text == ""


def test_warmup_fraction_is_a_fraction_of_the_decay_steps():
    kwargs = schedule_kwargs(_args(lr_warmup_fraction=0.25, lr_decay_iters=40), 100)
    assert kwargs["lr_warmup_steps"] == 10


def test_weight_decay_defaults_and_explicit_range():
    kwargs = schedule_kwargs(_args(weight_decay=0.1), 10)
    assert (kwargs["start_wd"], kwargs["end_wd"]) == (0.1, 0.1)
    kwargs = schedule_kwargs(
        _args(start_weight_decay=0.0, end_weight_decay=0.2, weight_decay_incr_style="linear"), 10
    )
    assert (kwargs["start_wd"], kwargs["end_wd"], kwargs["wd_incr_style"]) == (0.0, 0.2, "linear")


def test_wsd_decay_steps_and_a_missing_min_lr():
    kwargs = schedule_kwargs(
        _args(lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style="cosine", min_lr=None),
        20,
    )
    assert (kwargs["wsd_decay_steps"], kwargs["lr_wsd_decay_style"]) == (4, "cosine")
    assert kwargs["min_lr"] == 0.0


def test_sample_flags_count_optimizer_steps_of_the_global_batch():
    kwargs = schedule_kwargs(
        _args(train_samples=2000, lr_decay_samples=1000, lr_warmup_samples=300,
              lr_wsd_decay_samples=500, lr_decay_style="WSD", global_batch_size=100),
        None,
    )  # fmt: skip
    assert kwargs["lr_decay_steps"] == 10 and isinstance(kwargs["lr_decay_steps"], int)
    assert (kwargs["lr_warmup_steps"], kwargs["wsd_decay_steps"], kwargs["wd_incr_steps"]) == (
        3, 5, 20,
    )  # fmt: skip
    # Not a whole number of steps: Megatron-LM's sample-counted schedule exactly.
    kwargs = schedule_kwargs(_args(lr_decay_samples=1050, global_batch_size=100), None)
    assert kwargs["lr_decay_steps"] == 10.5


def test_override_and_use_checkpoint_pass_through():
    kwargs = schedule_kwargs(_args(override_opt_param_scheduler=True), 10)
    assert kwargs["override_opt_param_scheduler"] is True
    kwargs = schedule_kwargs(_args(use_checkpoint_opt_param_scheduler=True), 10)
    assert kwargs["use_checkpoint_opt_param_scheduler"] is True


# ----------------------------------------------------------------------------------------------
# schedule_kwargs: every error


@pytest.mark.parametrize(
    ("overrides", "total", "match"),
    [
        ({"lr": None}, 10, r"--lr = None: the train role needs a learning rate"),
        ({"min_lr": 2e-3}, 10, r"--min-lr = 0.002: must be in \[0, --lr = 0.001\]"),
        ({"lr_warmup_init": 2e-3}, 10, r"--lr-warmup-init = 0.002: must be in"),
        ({"lr_decay_style": "step"}, 10, r"--lr-decay-style = 'step': must be one of constant"),
        ({"lr_decay_samples": 1000}, 10,
         r"--lr-decay-samples = 1000: needs --global-batch-size to count optimizer steps"),
        ({"train_samples": 1000}, 10, r"--train-samples = 1000: needs --global-batch-size"),
        ({"lr_warmup_samples": 64}, 10, r"--lr-warmup-samples = 64: needs --global-batch-size"),
        ({"train_iters": 10, "train_samples": 1000, "global_batch_size": 10}, None,
         r"--train-samples = 1000: cannot be combined with --train-iters = 10"),
        ({"lr_warmup_iters": 2, "lr_warmup_samples": 64, "global_batch_size": 8}, 10,
         r"--lr-warmup-samples = 64: cannot be combined with --lr-warmup-iters = 2"),
        ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 2}, 10,
         r"--lr-warmup-fraction = 0.1: cannot be combined with --lr-warmup-iters = 2"),
        ({"lr_warmup_fraction": 0.1}, None,
         r"--lr-warmup-fraction = 0.1: needs a number of decay steps"),
        ({"lr_warmup_iters": 10}, 10,
         r"--lr-warmup-iters = 10: gives 10 warm-up steps: must be fewer than the 10 decay "
         r"steps of the run's total optimizer steps"),
        ({"lr_warmup_iters": 5, "train_iters": 4}, None,
         r"--lr-warmup-iters = 5: .* fewer than the 4 decay steps of --train-iters"),
        ({"lr_warmup_fraction": 1.0, "lr_decay_iters": 8}, None,
         r"--lr-warmup-fraction = 1.0: gives 8.0 warm-up steps: .* of --lr-decay-iters"),
        ({"lr_decay_iters": 0}, 10, r"--lr-decay-iters = 0: must give more than 0 decay steps"),
        ({"lr_decay_style": "WSD"}, 10, r"--lr-decay-style = 'WSD': needs --lr-wsd-decay-iters"),
        ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 2, "lr_wsd_decay_style": "step"}, 10,
         r"--lr-wsd-decay-style = 'step': must be one of"),
        ({"weight_decay_incr_style": "step"}, 10, r"--weight-decay-incr-style = 'step': must be"),
        ({"start_weight_decay": -0.1, "weight_decay_incr_style": "linear"}, 10,
         r"--start-weight-decay = -0.1: must be >= 0"),
        ({"start_weight_decay": 0.2, "end_weight_decay": 0.1, "weight_decay_incr_style": "linear"},
         10, r"--end-weight-decay = 0.1: must be >= 0.2"),
        ({"end_weight_decay": 0.2}, 10,
         r"--weight-decay-incr-style = 'constant': keeps one weight decay, but it goes from 0.01 "
         r"to 0.2"),
        ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True}, 10,
         r"--override-opt-param-scheduler = True: cannot be combined with "
         r"--use-checkpoint-opt-param-scheduler"),
    ],
)  # fmt: skip
def test_each_error_names_the_flag(overrides, total, match):
    with pytest.raises(ValueError, match=match) as err:
        schedule_kwargs(_args(**overrides), total)
    assert isinstance(err.value, ConfigError)


# ----------------------------------------------------------------------------------------------
# build_lr_scheduler: megatron-core's scheduler over a plain optimizer


def _sgd(**extra_group):
    """SGD with a default group and, with `extra_group`, a second one carrying megatron-core's
    per-group keys (as its param groups do)."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    if extra_group:
        groups.append({"params": [torch.nn.Parameter(torch.zeros(2))], **extra_group})
    return torch.optim.SGD(groups, lr=0.5)


def _reference_lr(step, warmup, decay, init_lr):
    """Megatron-LM's warm-up + cosine schedule, written out independently."""
    if step <= warmup:
        return init_lr + (LR - init_lr) * step / warmup
    if step > decay:
        return MIN_LR
    t, span = step - warmup, decay - warmup
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * t / span))


def test_warmup_then_cosine_matches_the_formula():
    init_lr = 1e-4
    optimizer = _sgd()
    args = _args(lr_warmup_iters=4, lr_warmup_init=init_lr, min_lr=MIN_LR, lr_decay_style="cosine")
    scheduler = build_lr_scheduler(optimizer, args, total_optimizer_steps=10)
    seen = []
    for _ in range(13):  # past the decay: min_lr
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    expected = [_reference_lr(k, 4, 10, init_lr) for k in range(13)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert seen[0] == init_lr and seen[4] == LR and seen[12] == MIN_LR


def test_each_group_follows_its_own_bounds_and_wd_mult():
    """A megatron-core group with a decoupled lr (default_config False) and wd_mult 0 (biases
    and norms); OptimizerConfig's min_lr None in every group is filled from the schedule."""
    optimizer = _sgd(max_lr=2 * LR, min_lr=None, wd_mult=0.0, default_config=False)
    optimizer.param_groups[0].update(max_lr=LR, min_lr=None, wd_mult=1.0, default_config=True)
    args = _args(lr_decay_iters=4, weight_decay=0.1, decoupled_lr=2 * LR)
    scheduler = build_lr_scheduler(optimizer, args, total_optimizer_steps=None)
    default, decoupled = optimizer.param_groups
    assert default["min_lr"] == 0.0 and decoupled["min_lr"] == 0.0
    scheduler.step(increment=1)  # linear: 3/4 of the way up from 0
    assert default["lr"] == pytest.approx(0.75 * LR) and decoupled["lr"] == pytest.approx(1.5 * LR)
    assert (default["weight_decay"], decoupled["weight_decay"]) == (0.1, 0.0)
    assert current_lr_and_wd(scheduler) == (pytest.approx(0.75 * LR), 0.1)


# ----------------------------------------------------------------------------------------------
# load_scheduler_state


def _stepped(args, num_steps):
    scheduler = build_lr_scheduler(_sgd(), args, total_optimizer_steps=10)
    for _ in range(num_steps):
        scheduler.step(increment=1)
    return scheduler


def test_a_saved_schedule_resumes_at_its_step():
    args = _args(lr_warmup_iters=2, lr_decay_style="cosine")
    saved = _stepped(args, 3)
    fresh = _stepped(args, 1)  # loading resets the count: load_state_dict adds to it
    fresh.optimizer.param_groups[0]["lr"] = 123.0  # what an optimizer's load leaves there
    load_scheduler_state(fresh, saved.state_dict(), args, "ckpt")
    assert fresh.num_steps == 3
    assert fresh.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]


def test_a_changed_schedule_needs_override_or_use_checkpoint():
    saved = _stepped(_args(lr_warmup_iters=2), 3).state_dict()
    changed = _args(lr_warmup_iters=1, lr=2 * LR)
    with pytest.raises(
        ValueError,
        match=r"--override-opt-param-scheduler = False: the lr schedule differs from the one "
        r"saved in ckpt: max_lr 0.001 -> 0.002, lr_warmup_steps 2 -> 1; hint: pass "
        r"--override-opt-param-scheduler",
    ):
        load_scheduler_state(_stepped(changed, 0), saved, changed, "ckpt")

    flags = _stepped(_args(lr_warmup_iters=1, lr=2 * LR, override_opt_param_scheduler=True), 0)
    flags.optimizer.param_groups[0]["max_lr"] = LR  # the checkpoint's, from the optimizer's load
    load_scheduler_state(flags, saved, changed, "ckpt")
    assert (flags.num_steps, flags.max_lr, flags.lr_warmup_steps) == (3, 2 * LR, 1)
    assert flags.optimizer.param_groups[0]["max_lr"] == 2 * LR

    kept = _stepped(_args(lr_warmup_iters=1, lr=2 * LR, use_checkpoint_opt_param_scheduler=True), 0)
    load_scheduler_state(kept, saved, changed, "ckpt")
    assert (kept.num_steps, kept.max_lr, kept.lr_warmup_steps) == (3, LR, 2)


def test_a_checkpoint_without_a_schedule_starts_at_step_0(caplog):
    args = _args(lr_warmup_iters=2, lr_warmup_init=1e-4)
    scheduler = _stepped(args, 0)
    scheduler.optimizer.param_groups[0]["lr"] = 123.0  # what an optimizer's load leaves there
    with caplog.at_level(logging.WARNING, logger=lr_schedule.__name__):
        load_scheduler_state(scheduler, None, args, "old-ckpt")
    assert scheduler.num_steps == 0 and scheduler.optimizer.param_groups[0]["lr"] == 1e-4
    assert "old-ckpt holds no lr scheduler state" in caplog.text
    assert "starts again at step 0" in caplog.text


def test_a_longer_run_of_a_constant_lr_resumes():
    """Raising trainer.num_steps changes the decay horizon; with one lr after the warm-up
    (style constant, or --min-lr = --lr) nothing the schedule does changes, so no error."""
    flat = _args(lr_warmup_iters=2, min_lr=LR)
    saved = _stepped(flat, 3).state_dict()
    longer = build_lr_scheduler(_sgd(), flat, total_optimizer_steps=30)
    load_scheduler_state(longer, saved, flat, "ckpt")
    assert longer.num_steps == 3
    decaying = _args(lr_warmup_iters=2)  # linear to 0: the horizon matters
    saved = _stepped(decaying, 3).state_dict()
    with pytest.raises(ValueError, match="lr_decay_steps 10 -> 30"):
        load_scheduler_state(
            build_lr_scheduler(_sgd(), decaying, total_optimizer_steps=30), saved, decaying, "ckpt"
        )
