"""The asynchronous GRPO loop: generation runs up to N policy versions ahead of training.

    engine host:  dataloader -> generate -> reward ==send==>            (validation when due)
                                  ^ admission: engine holds v >= s - N
                  weight thread: <==weights== receive v, load (wait: between batches;
                                                              in_flight: paused in place)
    Megatron:     ==receive==> logp -> ref_logp -> train -> param_update (sync v = s + 1, log)
                                ^ logp holds v_s
                  (PPO: ... ref_logp -> [reward_model] -> critic_values -> train -> critic_train
                   -> param_update; critic_values waits for the critic trained through s - 1)

Owned here: the Megatron ranks' pipeline (`run_learn_pipeline`, a declarative list of
`StageTask`s over `roles/learn.py`'s methods, and the thread that receives samples through the
exchange, `jobs/exchange.py`) and the entry point's loop (`run_grpo_async`). The engine host's
pipeline, its stages, admission and validation guards and its threads, is
`jobs/generate_pipeline.py:GeneratePipeline`, with refill's rounds; the staleness rule is
`scheduler/staleness.py`; the engine's users and the weight thread are `jobs/weight_thread.py`.
`GeneratePipeline` and `run_learn_pipeline` take any `Exchange`: on gloo ranks from the entry
point, or both in one process on a `LocalExchange` in unit tests.
Checkpoints: every rank meets the others at the boundary after each version (`boundary`, and
an engine host's `Boundaries` thread); an engine host records its untrained steps in
`PendingSteps` and saves them in its `checkpoint` stage; a resumed host starts with them
(`Resumed`): `jobs/async_checkpoint.py`.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.checkpoint.manager import CheckpointManager
from megatron_async_rl.jobs.async_checkpoint import Resumed
from megatron_async_rl.jobs.generate_pipeline import GeneratePipeline
from megatron_async_rl.jobs.grpo_sync import boundary, learn_stage_methods, learn_stages
from megatron_async_rl.jobs.parts import build_parts
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.observability.logs import leader_print
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.scheduler.queues import BoundedQueue
from megatron_async_rl.scheduler.scheduler import HelperThread, Scheduler, StageTask
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import Stage

logger = logging.getLogger(__name__)


def run_learn_pipeline(learn, exchange, clock: RankClock, cfg, rank: int, role: str,
                       checkpoints=None, start: int = 0, faults=None) -> None:  # fmt: skip
    """A Megatron rank's side of the asynchronous loop: every step from `start` trained and
    synced; with `checkpoints`, the boundary after each version (`jobs/async_checkpoint.py`);
    `faults`: the recipe's injected faults (`jobs/faults.py`)."""
    sched, steps = cfg.scheduler, cfg.trainer.num_steps
    timeout, capacity = sched.stage_timeout_s, sched.queue_capacity
    staleness = StalenessController(sched.generate_ahead_steps)
    who, context = f"role {role}, rank {rank}", {"role": role, "rank": rank, "stage": "receive"}
    chain = learn_stages(cfg)
    queues = [BoundedQueue(name, capacity) for name in ("samples", *(s.value for s in chain))]
    samples_q = queues[0]
    learn.critic_version = start  # a resumed critic holds the checkpoint's version
    last = [time.perf_counter()]

    def receive() -> None:
        for step in range(start, steps):
            samples_q.put(exchange.receive_step(step), timeout, context)
            scheduler.wake()
        samples_q.close()  # the stages downstream finish once they drained it

    def logp_ready(work: StepWork) -> str | None:
        receiver.check(who)
        return learn.logp_waits_for(work)

    def train(work: StepWork) -> StepWork:
        if faults is not None:
            faults.at_step(work.step)
        learn.train(work)
        work.batch_metrics.update(staleness.check_batch(work.step, work.token_versions()))
        return work

    def param_update(work: StepWork) -> StepWork:
        work.report.add_measured(exchange.sync_weights(work.step + 1))
        learn.weights_synced(work.step + 1)
        return work

    def log(work: StepWork) -> None:  # after param_update's span closed: its time is whole
        work.report.add_maxima(clock.timings(work.step))
        work.report.add_means(scheduler.metrics())
        work.report.add_means(clock.utilization())
        now = time.perf_counter()
        learn.log(work, now - last[0])
        last[0] = now
        if checkpoints is not None:
            boundary(checkpoints, work.step + 1, None, learn)

    def critic_ready(work: StepWork) -> str | None:
        receiver.check(who)
        return learn.critic_waits_for(work)

    works = learn_stage_methods(learn)
    works[Stage.TRAIN] = train
    guards = {Stage.LOGP: logp_ready, Stage.CRITIC_VALUES: critic_ready}
    tasks = [
        StageTask(clock.machine(stage), works[stage], inputs=queues[i], output=queues[i + 1],
                  guard=guards.get(stage))
        for i, stage in enumerate(chain)
    ]  # fmt: skip
    tasks.append(StageTask(clock.machine(Stage.PARAM_UPDATE), param_update, inputs=queues[-1],
                           finish=log))  # fmt: skip
    scheduler = Scheduler(tasks, role=role, rank=rank, timeout_s=timeout)
    receiver = HelperThread("samples-receiver", receive, scheduler.wake)
    receiver.start()
    try:
        scheduler.run()
    except Preempted:
        raise  # every rank stops at the same boundary: the receiver's peers are gone
    finally:
        samples_q.close()
    receiver.join(timeout=timeout)
    receiver.check(who)


def run_grpo_async(cfg, groups, platform, head_start=None) -> None:
    """Train for `trainer.num_steps` steps with generation up to N versions ahead; resumes
    from and saves checkpoints like the synchronous loop (collective over the world)."""
    checkpoints = CheckpointManager(cfg, groups)
    checkpoints.choose()  # a checkpoint of another recipe stops the run before engines start
    parts = build_parts(cfg, groups, platform, head_start)
    try:
        rank = groups.rank
        if parts.gen is not None and parts.learn is not None:
            raise RuntimeError(
                f"rank {rank}: the asynchronous loop needs generate ranks of their own "
                "(a rank holds generate and Megatron roles)"
            )
        start = checkpoints.restore(parts.gen, parts.learn, parts.exchange)
        steps = cfg.trainer.num_steps
        if start >= steps:
            leader_print(
                f"resumed at version {start}, trainer.num_steps is {steps}: nothing left to "
                "train (raise trainer.num_steps, or --resume never to start over)", rank,
            )  # fmt: skip
        dist.barrier(group=groups.control)  # engines are up
        try:
            if parts.gen is not None:
                first_host = groups.layout.engine_host_ranks()[0] == rank
                resumed = Resumed.from_checkpoint(checkpoints, first_host)
                GeneratePipeline(parts.gen, parts.exchange, parts.clock, cfg, rank,
                                 checkpoints, start, resumed).run()  # fmt: skip
            elif parts.learn is not None:
                role = "+".join(groups.local_roles())
                run_learn_pipeline(parts.learn, parts.exchange, parts.clock, cfg, rank, role,
                                   checkpoints, start, parts.faults)  # fmt: skip
            else:  # an engine follower (its host drives the engine): it meets the boundaries
                for version in range(start + 1, steps + 1):
                    boundary(checkpoints, version, None, None)
        except Preempted:  # every rank stops at the same boundary: the trace is written too
            parts.write_trace()
            raise
        parts.write_trace()
    finally:
        checkpoints.close()
        parts.close()
