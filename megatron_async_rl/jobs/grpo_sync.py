"""The synchronous GRPO loop: one policy version per step, every stage in turn.

    [validation] -> dataloader -> generate -> reward ==> logp -> ref -> train -> weight sync
    (engine hosts, when a version is due)          (samples)  (Megatron ranks)  (-> engines, logp)
    (PPO: ref -> [reward_model] -> critic_values -> train -> critic_train: `learn_stages`)

Owned here: the order of the stages of one step; the stages are the sides' methods
(`roles/generate.py`, `roles/learn.py`), the transfers the exchange's (`jobs/exchange.py`).
Called by the entry point on every rank (`trainer.job: grpo`, `generate_ahead_steps: 0`). This
loop is the independent reference of the asynchronous pipeline at zero steps ahead: the same
work and side methods, its own schedule. Each stage still runs under its stage machine, so
traces, `timing/*` and `utilization/*` come from the same clock as in the asynchronous loop; a
rank waiting for the weight sync to start (an engine host while rank 0 trains) is idle, not busy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch.distributed as dist

from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.checkpoint.manager import CheckpointManager
from megatron_async_rl.jobs.parts import build_parts
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.observability.logs import leader_print
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import Stage, StageState

S = StageState
GENERATE_STAGES = (Stage.DATALOADER, Stage.GENERATE, Stage.REWARD, Stage.VALIDATION)


def learn_stages(cfg) -> tuple[Stage, ...]:
    """The learn side's stages of a run, in order (each a `LearnSide` method:
    `learn_stage_methods`): logp (the batch laid out, and the logp role's pass where
    `algorithm.old_logprobs` is logp), with a placed ref role ref_logp, then with a placed
    reward model or critic its stages, train, and the critic's train after the actor's."""
    placed = cfg.roles.placed_roles()
    return tuple(
        stage for stage, role in (
            (Stage.LOGP, None), (Stage.REF_LOGP, "ref"), (Stage.REWARD_MODEL, "reward_model"),
            (Stage.CRITIC_VALUES, "critic"), (Stage.TRAIN, None), (Stage.CRITIC_TRAIN, "critic"),
        ) if role is None or role in placed
    )  # fmt: skip


def learn_stage_methods(learn) -> dict[Stage, Callable[[StepWork], StepWork]]:
    """The `LearnSide` method that runs each learn stage (`learn_stages` picks a run's)."""
    return {
        Stage.LOGP: learn.logp,
        Stage.REF_LOGP: learn.ref,
        Stage.REWARD_MODEL: learn.reward_model,
        Stage.CRITIC_VALUES: learn.critic_values,
        Stage.TRAIN: learn.train,
        Stage.CRITIC_TRAIN: learn.critic_train,
    }


@contextmanager
def running(machine, step: int | None, reason: str):
    """A stage's span outside a scheduler: `machine` RUNNING (for `step`) while the block runs
    (also the asynchronous loop's first load with refill, before its scheduler starts)."""
    machine.transition(S.RUNNING, reason, step=step)
    yield
    machine.transition(S.IDLE, "done")


def run_steps(gen, learn, exchange, clock: RankClock, cfg, checkpoints=None, start=0,
              faults=None) -> None:  # fmt: skip
    """Train steps `start`..`trainer.num_steps - 1` on this rank's sides (collective over the
    world); with `checkpoints` (a `CheckpointManager`), save when due, on a signal (then raise
    `Preempted`) and at the end. `faults`: the recipe's injected faults (`jobs/faults.py`)."""
    machines = {stage: clock.machine(stage) for stage in Stage}
    methods = learn_stage_methods(learn) if learn is not None else {}
    staleness = StalenessController(0)
    last = time.perf_counter()
    for step in range(start, cfg.trainer.num_steps):
        if faults is not None:
            faults.at_step(step)
        work = None
        if gen is not None:
            work = _rollout(gen, machines, clock, cfg, step)
            if learn is None:
                work.report.add_means(clock.utilization())
        learned = exchange.share_step(work, step)
        if learn is not None:
            before = "samples in"
            for stage in learn_stages(cfg):
                with running(machines[stage], step, before):
                    methods[stage](learned)
                before = f"{stage.value} done"
            learned.batch_metrics.update(staleness.check_batch(step, learned.token_versions()))
        update = machines[Stage.PARAM_UPDATE]
        update.transition(S.WAITING_INPUT, f"every rank at the sync of v{step + 1}", step=step)
        exchange.weights_ready()
        with running(update, step, f"sending v{step + 1}"):
            metrics = exchange.sync_weights(step + 1, gen.engine if gen is not None else None)
        timings = clock.timings(step)
        row = None
        if learn is not None:
            learn.weights_synced(step + 1)
            learned.report.add_measured(metrics)
            learned.report.add_maxima(timings)
            learned.report.add_means(clock.utilization())
            now = time.perf_counter()
            row = functools.partial(learn.log, learned, now - last)
            last = now
        if checkpoints is not None:
            boundary(checkpoints, step + 1, gen, learn, row)
        elif row is not None:
            row()


def boundary(checkpoints, version: int, gen, learn, row=None) -> None:
    """At the boundary after version `version` (collective): save if due, at the end, or on
    a signal (then raise `Preempted`); the HF export when due. The asynchronous loop's Megatron
    ranks and engine followers call it too (its engine hosts: `jobs/async_checkpoint.py`).

    `row`: writes the step's metrics (the synchronous loop's Megatron ranks): called once the
    ranks have agreed, before a save, so that an engine host that has nothing to save goes on
    to the next step's generation while the row is written (a step's logging, ~4 ms on the
    quick start, was on its critical path), and a saved version's rows are all written first."""
    save, preempted = checkpoints.boundary(version)
    if row is not None:
        row()
    metrics = {}
    if save:
        metrics = checkpoints.save(version, gen, learn)
    if learn is not None:
        learn.pending_metrics.update({**checkpoints.take_metrics(), **metrics})
    if checkpoints.export_due(version):
        checkpoints.export_hf(version, learn)
    if preempted:
        raise checkpoints.stop_error(version)


def _rollout(gen, machines, clock, cfg, step: int) -> StepWork:
    """An engine host's part of a step: validation when due, prompts, samples, rewards; with
    refill, rounds of them until the batch is complete (the engine hosts agree on each round,
    then draw the next round's prompts together: `rollout/refill.py`)."""
    validation = {}
    if gen.validator is not None and cfg.scheduler.validation_due(step):
        with running(machines[Stage.VALIDATION], None, f"version {step} is due"):
            validation = gen.validate(step)  # the engine holds v{step}: evaluate it
        validation["val/due_version"] = float(step)
    with running(machines[Stage.DATALOADER], step, "next prompts"):
        work = gen.load(step)
    while True:
        with running(machines[Stage.GENERATE], step, "prompts in"):
            gen.generate(work)
        with running(machines[Stage.REWARD], step, "samples in"):
            gen.score(work)
        if work.refill is None:
            break
        flags = gen.wait_round(work, cfg.scheduler.stage_timeout_s)
        with running(machines[Stage.DATALOADER], step, "refill round decided"):
            if gen.settle(work, flags):
                break
    work.report.add_means(validation)
    work.report.add_maxima(clock.timings(step, GENERATE_STAGES))
    work.report.add_maxima(clock.timings(None, GENERATE_STAGES))
    return work


def run_grpo_sync(cfg, groups, platform, head_start=None) -> None:
    """The synchronous loop of the entry point (collective over the world)."""
    checkpoints = CheckpointManager(cfg, groups)
    checkpoints.choose()  # a checkpoint of another recipe stops the run before engines start
    parts = build_parts(cfg, groups, platform, head_start)
    try:
        start = checkpoints.restore(parts.gen, parts.learn, parts.exchange)
        if start >= cfg.trainer.num_steps:
            leader_print(
                f"resumed at version {start}, trainer.num_steps is {cfg.trainer.num_steps}: "
                "nothing left to train (raise trainer.num_steps, or --resume never to start "
                "over)", groups.rank,
            )  # fmt: skip
        dist.barrier(group=groups.control)  # engines are up: step timings start clean
        try:
            run_steps(parts.gen, parts.learn, parts.exchange, parts.clock, cfg, checkpoints,
                      start, parts.faults)  # fmt: skip
        except Preempted:  # every rank stops at the same boundary: the trace is written too
            parts.write_trace()
            raise
        parts.write_trace()
    finally:
        checkpoints.close()
        parts.close()
