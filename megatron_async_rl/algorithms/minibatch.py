"""PPO mini-batches: which samples of a rollout batch each optimizer step trains on.

Owned here: the plan of one RL step's optimizer steps (`plan_minibatches`), their count
(`optimizer_steps_per_rl_step`), Megatron's batch-size rules (`check_minibatches`) and the G of
each RL step (`global_batch_size_at`). Megatron's `--global-batch-size` G is the number of
samples per optimizer step: a rollout batch of B samples gives B / G optimizer steps per epoch,
repeated `algorithm.ppo_epochs` times. G None: one step over the whole batch per epoch.
`roles/learn.py:train_on_batch` and `roles/critic.py:train_critic` run the plan; config
resolution calls `check_minibatches`. Pure: no torch, no collectives, no megatron (a run with
--rampup-batch-size or --decrease-batch-size-if-needed asks megatron-core's calculator through
`algorithms.batch_ramp`, imported only then).

Consumed samples: Megatron-LM feeds its batch-size calculator the samples its optimizer steps
have consumed. Here every optimizer step of RL step k trains on the same G (its mini-batches
cover the rollout batch), and the samples consumed before RL step k are k x B x ppo_epochs
(`batch_ramp.consumed_samples_before`): a function of k alone, so a resumed run continues a
ramp where it stopped and every data-parallel rank agrees.

Every data-parallel rank and every rerun must pick the same split, so the shuffle comes from
`random.Random` seeded by (seed, RL step, epoch) alone (a string seed is hashed with SHA-512, the
same in every process whatever PYTHONHASHSEED). An epoch of one mini-batch is never shuffled:
the samples are the same, and the order would only change float summation (so G = B is today's
single step bit for bit).
"""

from __future__ import annotations

import random

from megatron_async_rl.config.errors import ConfigError

FLAG = "--global-batch-size"


def _key(key_prefix: str) -> str:
    return f"{key_prefix}.global_batch_size" if key_prefix else FLAG


def _num_minibatches(num_samples: int, global_batch_size: int | None, key_prefix: str) -> int:
    """Mini-batches per epoch; ConfigError when G does not divide the rollout batch."""
    if global_batch_size is None:
        return 1
    if global_batch_size < 1 or num_samples % global_batch_size:
        raise ConfigError(
            _key(key_prefix),
            global_batch_size,
            f"{FLAG} (samples per optimizer step) must divide the rollout batch of "
            f"{num_samples} samples (rollout.num_prompts_per_step x "
            "algorithm.num_samples_per_prompt)",
            f"use a divisor of {num_samples}, or leave {FLAG} unset for one optimizer step "
            "per RL step",
        )
    return num_samples // global_batch_size


def optimizer_steps_per_rl_step(
    num_samples: int, global_batch_size: int | None, ppo_epochs: int
) -> int:
    """Optimizer steps one RL step takes: (B / G or 1) x ppo_epochs."""
    return _num_minibatches(num_samples, global_batch_size, "") * ppo_epochs


def run_optimizer_steps_per_rl_step(cfg) -> int:
    """`optimizer_steps_per_rl_step` of a resolved run config (its rollout batch, the train
    role's --global-batch-size and `algorithm.ppo_epochs`)."""
    return optimizer_steps_per_rl_step(
        cfg.rollout.num_prompts_per_step * cfg.algorithm.num_samples_per_prompt,
        cfg.role_megatron_args["train"].get("global_batch_size"),
        cfg.algorithm.ppo_epochs,
    )


def global_batch_size_at(
    args: dict, step: int, num_samples: int, ppo_epochs: int, dp_size: int
) -> int | None:
    """The G of RL step `step` for a role whose resolved Megatron args are `args`.

    --global-batch-size as given; with --rampup-batch-size or --decrease-batch-size-if-needed,
    the G megatron-core's calculator runs after `consumed_samples_before(step, ...)` samples
    (`batch_ramp.ramped_global_batch_size`, which checks every G of the run once first).
    """
    if args.get("rampup_batch_size") is None and not args.get("decrease_batch_size_if_needed"):
        return args.get("global_batch_size")
    from megatron_async_rl.algorithms import batch_ramp

    return batch_ramp.ramped_global_batch_size(args, step, num_samples, ppo_epochs, dp_size)


def plan_role_step(args: dict, num_samples: int, algo, seed: int, step: int, dp_size: int
                   ) -> list[list[int]]:  # fmt: skip
    """`plan_minibatches` of RL step `step` for a trained role (the actor, the critic) whose
    resolved Megatron args are `args`: its G at that step (`global_batch_size_at`), checked
    against its micro-batch and data-parallel sizes (`check_minibatches`)."""
    mbs = int(args.get("micro_batch_size") or 1)
    global_batch_size = global_batch_size_at(args, step, num_samples, algo.ppo_epochs, dp_size)
    if global_batch_size is not None:
        check_minibatches(num_samples, global_batch_size, mbs, dp_size)
    return plan_minibatches(num_samples, global_batch_size, algo.ppo_epochs,
                            algo.shuffle_minibatches, seed, step)  # fmt: skip


def plan_minibatches(
    num_samples: int,
    global_batch_size: int | None,
    ppo_epochs: int,
    shuffle: bool,
    seed: int,
    step: int,
) -> list[list[int]]:
    """The sample indices of each optimizer step of RL step `step`, in order.

    Each epoch covers every index once: in order without `shuffle` (or with one mini-batch per
    epoch), else a permutation seeded by (seed, step, epoch) cut into runs of G.
    """
    assert ppo_epochs >= 1, ppo_epochs  # GRPOConfig validates it
    num_mini = _num_minibatches(num_samples, global_batch_size, "")
    size = num_samples // num_mini
    plan = []
    for epoch in range(ppo_epochs):
        order = list(range(num_samples))
        if shuffle and num_mini > 1:
            random.Random(f"minibatch:{seed}:{step}:{epoch}").shuffle(order)
        plan += [order[i * size : (i + 1) * size] for i in range(num_mini)]
    return plan


def check_minibatches(
    num_samples: int,
    global_batch_size: int | None,
    micro_batch_size: int,
    dp_size: int,
    key_prefix: str = "",
) -> None:
    """Megatron's rules for G: it divides the rollout batch and is a multiple of
    micro_batch_size x dp_size (every data-parallel rank runs whole micro-batches). ConfigError
    names `--global-batch-size` (or `<key_prefix>.global_batch_size`) and the values."""
    _num_minibatches(num_samples, global_batch_size, key_prefix)
    if global_batch_size is None:
        return
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ConfigError(
            _key(key_prefix),
            global_batch_size,
            f"{FLAG} must be a multiple of the micro-batch size x data-parallel size = "
            f"{micro_batch_size} x {dp_size} = {per_step}",
            f"use a multiple of {per_step} that divides the rollout batch of {num_samples}",
        )


def check_virtual_pipeline_microbatches(
    num_micro: int, micro_batch_size: int, pp: int, vp: int, group: int | None, where: str
) -> None:
    """megatron-core's rules for the micro-batches of one pass through the interleaved schedule
    (`vp` > 1 model chunks per pipeline rank): at least N of them, and a count whose remainder
    after groups of N is 0 or >= `pp` (N: --microbatch-group-size-per-virtual-pipeline-stage,
    `group`, default `pp`). ConfigError naming --micro-batch-size, the batch and the rule."""
    group = group or pp
    if num_micro >= group and (num_micro % group == 0 or num_micro % group >= pp):
        return
    raise ConfigError(
        "--micro-batch-size", micro_batch_size,
        f"{where}: a pass of {num_micro * micro_batch_size} samples in {num_micro} micro-"
        f"batches, but the interleaved schedule ({vp} virtual pipeline stages per rank, "
        f"pipeline size {pp}) needs at least N = {group} micro-batches and a count whose "
        f"remainder after groups of N is 0 or >= {pp} (N: --microbatch-group-size-per-virtual-"
        "pipeline-stage, default the pipeline size)",
        f"use micro-batches that give a multiple of {group} per pass",
    )  # fmt: skip


def check_role_microbatches(role: str, args: dict, num_samples: int, dp_size: int) -> None:
    """`check_virtual_pipeline_microbatches` for each pass a Megatron role with virtual pipeline
    stages runs over a rollout batch of `num_samples`: its forward over every sample (logp,
    ref, the critic's values, the reward model's scores), and a trained role's optimizer step
    over its data-parallel share of --global-batch-size (or of the batch). Nothing to check
    without virtual stages."""
    from megatron_async_rl.config.megatron.core_kwargs import virtual_stages

    vp, pp = virtual_stages(args), int(args.get("pipeline_model_parallel_size") or 1)
    if vp == 1:
        return
    from megatron_async_rl.config.roles import TRAINED_ROLES

    group = args.get("microbatch_group_size_per_vp_stage")
    mbs = args.get("micro_batch_size")
    if role != "train":  # its forward passes (a micro-batch of the whole batch when unset)
        size = mbs or num_samples
        if num_samples % size == 0:
            check_virtual_pipeline_microbatches(
                num_samples // size, size, pp, vp, group, f"role {role}'s forward"
            )
    if role in TRAINED_ROLES:
        gbs = args.get("global_batch_size") or num_samples
        size = int(mbs or 1)
        if gbs % (size * dp_size) == 0:  # else `check_minibatches` names --global-batch-size
            check_virtual_pipeline_microbatches(
                gbs // (size * dp_size), size, pp, vp, group,
                f"role {role}'s optimizer step (--global-batch-size {gbs} over {dp_size} "
                "data-parallel ranks)",
            )  # fmt: skip
