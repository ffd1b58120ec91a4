"""Megatron-LM's --rampup-batch-size and --decrease-batch-size-if-needed: the G of each RL step,
as megatron-core's own calculator (`megatron.core.num_microbatches_calculator`) gives it.

Owned here: `ramped_global_batch_size` (the G RL step k runs), `batch_sizes` (every G a run
takes, with the RL step where it starts) and `check_batch_ramp` (the rules those G must meet).
Called by `algorithms.minibatch.global_batch_size_at` (the roles' train stages) and by
`recipe.load` when it resolves a run. Deterministic and collective-free, but it imports
megatron-core (seconds), so `minibatch` imports it only when one of the two flags is set.

The calculator is asked at the samples consumed before each RL step,
`consumed_samples_before` (k x B x algorithm.ppo_epochs for rollout batches of B):
    --rampup-batch-size <start> <increment> <ramp samples>: G starts at `start` and grows by
    `increment` every (ramp samples) / ((G - start) / increment) samples, then stays at
    --global-batch-size;
    --decrease-batch-size-if-needed: the G run is the calculator's rounded down to a multiple of
    micro-batch size x data-parallel size (without it, such a G is an error).
An RL step's G holds for all its optimizer steps, so only the values at RL-step boundaries are
ever run (B = 64, ramp 16 16 128 to G = 64: 16, 32, 64, 64, ...; 48 is skipped). Each of them
must divide B; one that does not, or that breaks Megatron's micro-batch rule, is an error
listing every such G. The lr schedule counts samples in units of G
(`roles.lr_schedule.scheduler_increment`), as Megatron-LM counts its schedule in samples.

A G that changes over the run cannot be combined with the flags this trainer counts as RL steps
x a fixed number of optimizer steps: --train-iters (Megatron-LM refuses it with a ramp too),
--iterations-to-skip, --exit-interval, --save-interval.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megatron_async_rl.config.errors import ConfigError

RAMP_FLAG = "--rampup-batch-size"
DECREASE_FLAG = "--decrease-batch-size-if-needed"
_QUIET_RANK = -1
"""megatron-core's calculators log every G on rank 0; the metric actor/global_batch_size does."""

_COUNTED_IN_STEPS = {
    "train_iters": "use --train-samples (an RL step consumes the same samples whatever its G) "
    "or trainer.num_steps",
    "iterations_to_skip": "drop it",
    "exit_interval": "drop it (trainer.num_steps or --exit-duration-in-mins end the run)",
    "save_interval": "use checkpoint.every_steps (RL steps)",
}


def consumed_samples_before(step: int, num_samples: int, ppo_epochs: int) -> int:
    """Samples Megatron counts as consumed (through the optimizer) before RL step `step`: each
    earlier RL step trained on its `num_samples` samples `ppo_epochs` times."""
    return step * num_samples * ppo_epochs


@dataclass(frozen=True)
class BatchFlags:
    """The flags of one role that decide its G per RL step (from its resolved Megatron args)."""

    global_batch_size: int | None
    rampup: tuple[int, ...] | None
    decrease: bool
    micro_batch_size: int

    @classmethod
    def of(cls, args: dict[str, Any]) -> BatchFlags:
        ramp = args.get("rampup_batch_size")
        return cls(
            args.get("global_batch_size"),
            tuple(ramp) if isinstance(ramp, (list, tuple)) else ramp,
            bool(args.get("decrease_batch_size_if_needed")),
            int(args.get("micro_batch_size") or 1),
        )


def _calculator(flags: BatchFlags, dp_size: int):
    """megatron-core's calculator for `flags` (checked by `_check_shape` first)."""
    from megatron.core import num_microbatches_calculator as calculators

    common = (flags.global_batch_size, flags.micro_batch_size, dp_size, flags.decrease)
    if flags.rampup is None:
        return calculators.ConstantNumMicroBatchesCalculator(*common, _QUIET_RANK)
    return calculators.RampupBatchsizeNumMicroBatchesCalculator(*common, _QUIET_RANK, *flags.rampup)


@functools.cache
def _batch_sizes(
    flags: BatchFlags, num_samples: int, ppo_epochs: int, dp_size: int
) -> tuple[tuple[int, int, int], ...]:
    calc = _calculator(flags, dp_size)

    def at(step: int) -> tuple[int, int]:
        calc.update(consumed_samples_before(step, num_samples, ppo_epochs), False)
        return calc.get_current_global_batch_size(), calc.get_current_running_global_batch_size()

    per_step = consumed_samples_before(1, num_samples, ppo_epochs)
    # from this RL step on, more than the ramp's samples are consumed: G is the final one
    last = flags.rampup[2] // per_step + 1 if flags.rampup else 0
    step, value, out = 0, at(0), []
    while True:
        out.append((step, *value))
        if step >= last or at(last) == value:
            return tuple(out)
        low, high = step + 1, last  # the first RL step with another G (G never decreases)
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if at(mid) != value else (mid + 1, high)
        step, value = low, at(low)


def batch_sizes(
    args: dict[str, Any], num_samples: int, ppo_epochs: int, dp_size: int
) -> tuple[tuple[int, int, int], ...]:
    """(first RL step, the calculator's G, the G run) of every G a run takes, in order; the
    last holds from its step on. Found by bisection on megatron-core's calculator."""
    flags = BatchFlags.of(args)
    _check_shape(flags)
    return _sizes(flags, num_samples, ppo_epochs, dp_size)


def _sizes(flags: BatchFlags, num_samples: int, ppo_epochs: int, dp_size: int):
    gbs, per_rank = flags.global_batch_size, flags.micro_batch_size * dp_size
    if flags.rampup is None and flags.decrease and gbs < per_rank:
        return ((0, gbs, 0),)  # megatron-core asserts at least one micro-batch here
    return _batch_sizes(flags, num_samples, ppo_epochs, dp_size)


def _check_shape(flags: BatchFlags) -> None:
    """What megatron-core's calculators need before they can be built."""
    gbs, ramp = flags.global_batch_size, flags.rampup
    flag, value = (RAMP_FLAG, list(ramp)) if ramp is not None else (DECREASE_FLAG, True)
    if gbs is None:
        raise ConfigError(flag, value, "needs --global-batch-size (the G it ends at or lowers)")
    if ramp is None:
        return
    _check_ramp_available(value)
    if len(ramp) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in ramp):
        raise ConfigError(flag, value, "takes three integers: <start> <increment> <ramp samples>")
    start, increment, samples = ramp
    if not 0 < start < gbs:
        raise ConfigError(flag, value, f"<start> must be in [1, --global-batch-size = {gbs})")
    if increment < 1 or (gbs - start) % increment:
        raise ConfigError(
            flag, value, f"<increment> must divide --global-batch-size - <start> = {gbs - start}"
        )
    if samples < 1:
        raise ConfigError(flag, value, "<ramp samples> must be >= 1 (megatron-core divides by it)")


def _check_ramp_available(value) -> None:
    """megatron-core 0.19 removed its ramp calculator: `--rampup-batch-size` is deprecated there
    for `--step-batch-size-schedule` and ignored by Megatron-LM itself."""
    from megatron.core import num_microbatches_calculator as calculators

    if hasattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator"):
        return
    import importlib.metadata

    raise ConfigError(
        RAMP_FLAG, value,
        f"needs megatron-core's batch-size ramp, which megatron-core "
        f"{importlib.metadata.version('megatron-core')} no longer has (deprecated for "
        "--step-batch-size-schedule, which this trainer does not apply; Megatron-LM 0.19 ignores "
        "the flag)",
        "drop it (a fixed --global-batch-size), or use megatron-core 0.16.x for the ramp",
    )  # fmt: skip


def _check_fixed_step_flags(args: dict[str, Any], why: str) -> None:
    for dest, fix in _COUNTED_IN_STEPS.items():
        if args.get(dest):
            raise ConfigError(
                "--" + dest.replace("_", "-"), args[dest],
                f"counts optimizer steps as RL steps x a fixed number here, and {why} changes "
                "that number from one RL step to the next", fix,
            )  # fmt: skip


def check_batch_ramp(
    args: dict[str, Any], num_samples: int, ppo_epochs: int, dp_size: int | None = None
) -> None:
    """ConfigError naming the flag, its value, the rule and a fix, for every G of the run that
    breaks Megatron's rules or the rollout batch's (see the module docstring).

    `dp_size` None (config resolution, before the layout): what does not depend on it; the
    train stages check the rest with their data-parallel size before their first step.
    """
    flags = BatchFlags.of(args)
    if flags.rampup is None and not flags.decrease:
        return
    _check_shape(flags)
    if flags.rampup is not None:
        _check_fixed_step_flags(args, RAMP_FLAG)
    if dp_size is None and flags.decrease:
        return  # the G run depends on the data-parallel size
    _check_sizes(flags, args, num_samples, ppo_epochs, dp_size)


def _check_sizes(flags, args, num_samples: int, ppo_epochs: int, dp_size: int | None) -> None:
    flag, value = (RAMP_FLAG, list(flags.rampup)) if flags.rampup else (DECREASE_FLAG, True)
    per_rank = flags.micro_batch_size * (dp_size or 1)
    gbs = flags.global_batch_size
    sizes = _sizes(flags, num_samples, ppo_epochs, dp_size or 1)
    product = f"micro-batch size x data-parallel size = {flags.micro_batch_size} x {dp_size}"
    # (applies, broken(G run), rule, fix); a G's own value is named, and the one it runs
    rules = (
        (
            not flags.decrease and dp_size is not None,
            lambda g: g % per_rank,
            f"must be a multiple of {product} = {per_rank}",
            f"add {DECREASE_FLAG}, or use a start and an increment that are multiples of "
            f"{per_rank}",  # only a ramp gets here: G alone is check_minibatches'
        ),
        (
            flags.decrease,
            lambda g: g == 0,
            f"round down to 0 as multiples of {product} = {per_rank}",
            f"use a --global-batch-size{' and a ramp start' if flags.rampup else ''} of at "
            f"least {per_rank}",
        ),
        (
            True,
            lambda g: num_samples % g,
            f"must divide the rollout batch of {num_samples} samples "
            "(rollout.num_prompts_per_step x algorithm.num_samples_per_prompt)",
            (
                f"use a ramp whose G at every RL step divides {num_samples} (RL step k runs "
                f"the G at k x {consumed_samples_before(1, num_samples, ppo_epochs)} samples)"
                if flags.rampup
                else f"use a --global-batch-size whose multiples of {per_rank} divide "
                f"{num_samples}"
            )
            + ", or another rollout batch",
        ),
    )  # fmt: skip
    for applies, broken, rule, fix in rules:
        bad = [(step, g, run) for step, g, run in sizes if applies and broken(run)]
        if bad:
            listed = ", ".join(
                f"{g}{f' (run as {run})' if run != g else ''}"
                + (f" from RL step {step}" if flags.rampup else "")
                for step, g, run in bad
            )
            raise ConfigError(
                flag, value, f"the global batch sizes it gives, {listed}, {rule}", fix
            )
    if flags.rampup is None and sizes[0][2] != gbs:
        _check_fixed_step_flags(args, f"{DECREASE_FLAG} (G = {gbs} runs as {sizes[0][2]})")


def ramped_global_batch_size(
    args: dict[str, Any], step: int, num_samples: int, ppo_epochs: int, dp_size: int
) -> int:
    """The G RL step `step` runs: megatron-core's calculator after the samples consumed before
    it; every G of the run is checked first (`check_batch_ramp`; its G are cached)."""
    check_batch_ramp(args, num_samples, ppo_epochs, dp_size)
    calc = _calculator(BatchFlags.of(args), dp_size)
    calc.update(consumed_samples_before(step, num_samples, ppo_epochs), True)
    return calc.get_current_running_global_batch_size()
