"""The train role's learning-rate and weight-decay schedule: megatron-core's own
`OptimizerParamScheduler`, counted in optimizer steps of --global-batch-size samples.

Owned here: turning the train role's resolved Megatron args into the scheduler's arguments
(`schedule_kwargs`: pure, no process group, no megatron import), building the scheduler over the
role's optimizer (`build_lr_scheduler`), reading the lr and weight decay an update uses
(`current_lr_and_wd`) and restoring a saved schedule (`load_scheduler_state`). Called by
`roles.megatron_role.MegatronRole` (build, then `step(scheduler_increment(...))` once per
applied optimizer step) and by `checkpoint.megatron_state` (its `state_dict()` in the
checkpoint's common part).

Units: Megatron-LM counts its scheduler in samples (each iteration adds the global batch size
it ran, and its iteration flags are multiplied by --global-batch-size). Here one scheduler step
is --global-batch-size G samples: iteration flags are used as they are, sample flags are divided
by G (exactly, a float when it does not divide), and an optimizer step over G_k samples advances
the schedule by G_k / G (`scheduler_increment`): 1 per optimizer step, except while
--rampup-batch-size ramps G up or --decrease-batch-size-if-needed lowers it
(`algorithms.batch_ramp`), which gives Megatron-LM's schedule there too.

Rules, as Megatron-LM's `get_optimizer_param_scheduler` and `validate_args` apply them:
- decay steps: --lr-decay-iters, else --train-iters, else the run's total optimizer steps (the
  caller's `total_optimizer_steps`). With none of them there is no horizon to decay over: the
  lr stays at --lr after the warm-up (decay style `constant`, saying once that the configured
  style is ignored);
- warm-up steps: --lr-warmup-fraction x decay steps when the fraction is set, else
  --lr-warmup-iters; the warm-up goes linearly from --lr-warmup-init to --lr and must end before
  the decay does; the update of step k (from 0) uses the lr at k, so with a warm-up from 0 the
  first update has lr 0, as in Megatron-LM;
- weight decay: from --start-weight-decay to --end-weight-decay (both default to
  --weight-decay) over --train-iters (else the total, else the decay steps), in
  --weight-decay-incr-style; each param group's `wd_mult` scales it (0 for biases and norms);
- WSD: the last --lr-wsd-decay-iters of the decay steps anneal in --lr-wsd-decay-style.
Param groups carry their own `max_lr`/`min_lr` (megatron-core: --decoupled-lr for embeddings and
the output layer); megatron-core 0.16.1's scheduler does not read `lr_mult`.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_async_rl.config.errors import ConfigError, warn_once

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# The scheduler values `OptimizerParamScheduler.load_state_dict` compares with the checkpoint's.
_CHECKED = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
_CHECKED_WD = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _first(*values):
    return next((v for v in values if v is not None), None)


def _steps(args: dict[str, Any], iters: str, samples: str, unset=None):
    """(optimizer steps, flag, value given) from an iteration flag or its samples twin, all None
    if neither is set (None, or `unset`: 0 for the warm-up flags)."""
    num_iters, num_samples = args.get(iters), args.get(samples)
    iters_set, samples_set = num_iters not in (None, unset), num_samples not in (None, unset)
    if iters_set and samples_set:
        raise ConfigError(
            _flag(samples), num_samples, f"cannot be combined with {_flag(iters)} = {num_iters}",
            "count in iterations or in samples, not both",
        )  # fmt: skip
    if iters_set:
        return num_iters, _flag(iters), num_iters
    if not samples_set:
        return None, None, None
    batch = args.get("global_batch_size")
    if not batch:
        raise ConfigError(
            _flag(samples), num_samples, "needs --global-batch-size to count optimizer steps"
        )
    steps = num_samples // batch if num_samples % batch == 0 else num_samples / batch
    return steps, _flag(samples), num_samples


def scheduler_increment(args: dict[str, Any], step_samples: int) -> int | float:
    """How far an applied optimizer step over `step_samples` samples (all data-parallel ranks)
    advances the schedule: step_samples / --global-batch-size; 1 when they are equal or G is
    unset (one optimizer step over the whole rollout batch)."""
    batch = args.get("global_batch_size")
    return 1 if not batch or step_samples == batch else step_samples / batch


def schedule_kwargs(args: dict[str, Any], total_optimizer_steps: int | None) -> dict[str, Any]:
    """`OptimizerParamScheduler`'s constructor arguments but the optimizer, in optimizer steps.

    `args`: the train role's resolved Megatron args (Megatron-LM dests); `total_optimizer_steps`:
    the run's optimizer steps, the decay horizon when neither --lr-decay-iters nor --train-iters
    is set (None: unknown). Raises ConfigError (a ValueError) naming the flag for every setting
    the scheduler would reject or misread.
    """
    lr = args.get("lr")
    if lr is None:
        raise ConfigError("--lr", None, "the train role needs a learning rate")
    min_lr = _first(args.get("min_lr"), 0.0)
    init_lr = _first(args.get("lr_warmup_init"), 0.0)
    if not 0.0 <= min_lr <= lr:
        raise ConfigError("--min-lr", min_lr, f"must be in [0, --lr = {lr}]")
    if not 0.0 <= init_lr <= lr:
        raise ConfigError("--lr-warmup-init", init_lr, f"must be in [0, --lr = {lr}]")
    style = args.get("lr_decay_style", "linear")
    if style not in LR_DECAY_STYLES:
        raise ConfigError("--lr-decay-style", style, f"must be one of {', '.join(LR_DECAY_STYLES)}")

    train_steps, train_flag, _ = _steps(args, "train_iters", "train_samples")
    decay_steps, decay_flag, _ = _steps(args, "lr_decay_iters", "lr_decay_samples")
    if decay_steps is None and train_steps is not None:
        decay_steps, decay_flag = train_steps, train_flag
    if decay_steps is None and total_optimizer_steps is not None:
        decay_steps, decay_flag = total_optimizer_steps, "the run's total optimizer steps"

    fraction = args.get("lr_warmup_fraction")
    warmup_steps, warmup_flag, warmup_value = _steps(
        args, "lr_warmup_iters", "lr_warmup_samples", unset=0
    )
    if fraction is not None:
        if warmup_flag is not None:
            raise ConfigError(
                "--lr-warmup-fraction", fraction,
                f"cannot be combined with {warmup_flag} = {warmup_value}", "set one of them",
            )  # fmt: skip
        if decay_steps is None:
            raise ConfigError(
                "--lr-warmup-fraction", fraction, "needs a number of decay steps",
                "set --lr-decay-iters or --train-iters",
            )  # fmt: skip
        warmup_flag, warmup_value = "--lr-warmup-fraction", fraction
        warmup_steps = fraction * decay_steps
    warmup_steps = warmup_steps or 0

    if decay_steps is None:
        if style != "constant":
            warn_once(
                f"--lr-decay-style {style} is ignored: with no --lr-decay-iters, --train-iters or "
                "total optimizer steps there is nothing to decay over; the lr stays at --lr "
                "after the warm-up (constant)"
            )
        # The constant style never reads the decay steps past the warm-up; any later step will do.
        style, decay_steps = "constant", warmup_steps + 1
    elif decay_steps <= 0:
        raise ConfigError(decay_flag, decay_steps, "must give more than 0 decay steps")
    elif warmup_steps >= decay_steps:
        raise ConfigError(
            warmup_flag, warmup_value,
            f"gives {warmup_steps} warm-up steps: must be fewer than the {decay_steps} decay "
            f"steps of {decay_flag}", "shorten the warm-up or lengthen the decay",
        )  # fmt: skip

    wsd_steps, _, _ = _steps(args, "lr_wsd_decay_iters", "lr_wsd_decay_samples")
    wsd_style = args.get("lr_wsd_decay_style", "exponential")
    if style == "WSD":
        if wsd_steps is None:
            raise ConfigError("--lr-decay-style", style, "needs --lr-wsd-decay-iters")
        if wsd_style not in WSD_DECAY_STYLES:
            raise ConfigError(
                "--lr-wsd-decay-style", wsd_style, f"must be one of {', '.join(WSD_DECAY_STYLES)}"
            )

    start_wd, end_wd, wd_style = _weight_decay(args)
    override = bool(args.get("override_opt_param_scheduler", False))
    use_checkpoint = bool(args.get("use_checkpoint_opt_param_scheduler", False))
    if override and use_checkpoint:
        raise ConfigError(
            "--override-opt-param-scheduler", True,
            "cannot be combined with --use-checkpoint-opt-param-scheduler", "pick one",
        )  # fmt: skip
    return {
        "init_lr": init_lr,
        "max_lr": lr,
        "min_lr": min_lr,
        "lr_warmup_steps": warmup_steps,
        "lr_decay_steps": decay_steps,
        "lr_decay_style": style,
        "start_wd": start_wd,
        "end_wd": end_wd,
        "wd_incr_steps": _first(train_steps, total_optimizer_steps, decay_steps),
        "wd_incr_style": wd_style,
        "use_checkpoint_opt_param_scheduler": use_checkpoint,
        "override_opt_param_scheduler": override,
        "wsd_decay_steps": wsd_steps,
        "lr_wsd_decay_style": wsd_style,
    }


def _weight_decay(args: dict[str, Any]) -> tuple[float, float, str]:
    """(start, end, increment style) of the weight decay."""
    weight_decay = _first(args.get("weight_decay"), 0.01)
    start_wd = _first(args.get("start_weight_decay"), weight_decay)
    end_wd = _first(args.get("end_weight_decay"), weight_decay)
    wd_style = args.get("weight_decay_incr_style", "constant")
    if wd_style not in WD_INCR_STYLES:
        raise ConfigError(
            "--weight-decay-incr-style", wd_style, f"must be one of {', '.join(WD_INCR_STYLES)}"
        )
    if start_wd < 0:
        raise ConfigError("--start-weight-decay", start_wd, "must be >= 0")
    if end_wd < start_wd:
        raise ConfigError("--end-weight-decay", end_wd, f"must be >= {start_wd} at the start")
    if wd_style == "constant" and start_wd != end_wd:
        raise ConfigError(
            "--weight-decay-incr-style", wd_style,
            f"keeps one weight decay, but it goes from {start_wd} to {end_wd}",
            "use linear or cosine, or set --weight-decay alone",
        )  # fmt: skip
    return start_wd, end_wd, wd_style


def build_lr_scheduler(optimizer, args: dict[str, Any], total_optimizer_steps: int | None):
    """megatron-core's `OptimizerParamScheduler` over `optimizer` (anything with `param_groups`),
    at step 0: it sets every group's lr and weight decay at once."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    kwargs = schedule_kwargs(args, total_optimizer_steps)
    _set_group_bounds(optimizer, args, kwargs["max_lr"], kwargs["min_lr"], from_flags=False)
    return OptimizerParamScheduler(optimizer, **kwargs)


def _set_group_bounds(optimizer, args, max_lr: float, min_lr: float, from_flags: bool) -> None:
    """Each param group's `max_lr`/`min_lr`, which the scheduler reads over its own: from the
    flags when `from_flags`, else only where None (megatron-core's groups copy OptimizerConfig's
    min_lr, None by default; Megatron-LM's is 0.0). Groups off the default schedule are
    megatron-core's --decoupled-lr groups."""
    decoupled_lr, decoupled_min_lr = args.get("decoupled_lr"), args.get("decoupled_min_lr")
    for group in optimizer.param_groups:
        bounds = {"max_lr": max_lr, "min_lr": min_lr}
        if not group.get("default_config", True) and decoupled_lr is not None:
            bounds = {"max_lr": decoupled_lr, "min_lr": _first(decoupled_min_lr, min_lr)}
        for key, value in bounds.items():
            if key in group and (from_flags or group[key] is None):
                group[key] = value


def current_lr_and_wd(scheduler) -> tuple[float, float]:
    """(lr, weight decay) the next optimizer step uses, as the scheduler last set them: the lr of
    the first group on the default schedule (megatron-core's choice for logging; groups with a
    decoupled lr differ) and the weight decay before each group's `wd_mult`."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(scheduler.optimizer.param_groups)
    return float(scheduler.get_lr({}) if lr is None else lr), float(scheduler.get_wd())


def _flat(state: dict) -> bool:
    """Whether a saved or current schedule keeps one lr after its warm-up."""
    return state.get("lr_decay_style") == "constant" or state.get("max_lr") == state.get("min_lr")


def load_scheduler_state(scheduler, state: dict | None, args: dict[str, Any], source: str) -> None:
    """Restore a saved schedule into a scheduler built from the flags `args`, after the
    optimizer's own load (which gave its param groups the checkpoint's lr and lr bounds).

    As Megatron-LM does: the step count always comes from the checkpoint; the other values must
    match the flags' unless --override-opt-param-scheduler (the flags' win, the param groups'
    lr bounds included) or --use-checkpoint-opt-param-scheduler (the checkpoint's win). A
    mismatch without either is a ConfigError listing every difference (megatron-core asserts on
    the first). `state` None (a checkpoint written before the schedule was saved): the
    schedule starts again at step 0, said in a warning.
    """
    override = scheduler.override_opt_param_scheduler
    _set_group_bounds(scheduler.optimizer, args, scheduler.max_lr, scheduler.min_lr, override)
    if state is None:
        logger.warning(
            "role train: %s holds no lr scheduler state (saved before it was checkpointed): the "
            "lr schedule starts again at step 0", source,
        )  # fmt: skip
        scheduler.num_steps = 0
        scheduler.step(increment=0)  # the groups' lr, which the optimizer's load replaced
        return
    if not (override or scheduler.use_checkpoint_opt_param_scheduler):
        now = scheduler.state_dict()
        keys = _CHECKED + (_CHECKED_WD if "start_wd" in state else ())
        if _flat(state) and _flat(now):  # a longer run of a constant lr changes nothing
            keys = tuple(k for k in keys if k not in ("lr_decay_steps", "lr_decay_style"))
        if state.get("start_wd") == state.get("end_wd") and now["start_wd"] == now["end_wd"]:
            keys = tuple(k for k in keys if k != "wd_incr_steps")  # nor of a constant wd
        changed = [f"{k} {state[k]!r} -> {now[k]!r}" for k in keys if state.get(k) != now[k]]
        if changed:
            raise ConfigError(
                "--override-opt-param-scheduler", False,
                f"the lr schedule differs from the one saved in {source}: {', '.join(changed)}",
                "pass --override-opt-param-scheduler to keep the flags' schedule, or "
                "--use-checkpoint-opt-param-scheduler to keep the checkpoint's",
            )  # fmt: skip
        unchecked = [k for k in _CHECKED + _CHECKED_WD if k not in keys and k in state]
        state = {**state, **{k: now[k] for k in unchecked}}  # megatron-core would assert on them
    scheduler.num_steps = 0  # load_state_dict adds the saved count to the current one
    scheduler.load_state_dict(state)
