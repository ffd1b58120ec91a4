"""The asynchronous GRPO loop: generation of the next steps overlaps learning on the current one.

    generate ranks, main thread      generate s ──> send S_s ──> [admit s+1: v >= s+1-N] ──> ...
    generate ranks, weight thread    receive W_1, W_2, ... (kept pending; loaded per mode)
    Megatron ranks, main thread      receive S_s ──> logp, ref, advantages, train ──> send W_s+1

    stage        waits for (state WAITING_INPUT)                      bounded by
    generate     engine weights v >= s - N (StalenessController)       stage_timeout_s
    send S_s     the Megatron ranks to take step s (samples group)     stage_timeout_s (gloo)
    learn        samples of step s                                     stage_timeout_s (gloo)
    weights      the next version from the train role (weight group)   stage_timeout_s (gloo)

Owned here: the thread structure of a generate rank and the admission rule. Called by the entry
point when `scheduler.generate_ahead_steps` (N) > 0 or `scheduler.loop: async`; at N = 0 it
reduces to `jobs/grpo_sync.py`, the reference, bit for bit (tested). Bounded off-policy:
generation of step s starts only once the engine holds version s - N or newer
(`scheduler/staleness.py`), and every batch is checked where it is consumed, so a token
trained at step k was produced by a version in [k - N, k].
Weight updates (`scheduler.weight_update_mode`): `wait` loads a received version between two
batches; `in_flight` pauses the engine in place, loads, and continues the same requests, whose
later tokens then carry the new version.

The Megatron ranks run the same step body as the synchronous loop (`jobs/stages.py`); only the
generate ranks change. Each gloo group is used by one thread per rank (samples: main thread;
weight_sync: the weight thread), so the two directions never wait on each other.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from megatron_async_rl.jobs.stages import Job, exchange_samples, token_versions
from megatron_async_rl.observability.metrics import StepTimer
from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import Stage, StageState, StageTimeout
from megatron_async_rl.weight_sync.broadcast import (
    broadcast_weights,
    load_into_engine,
    sync_weights,
)

logger = logging.getLogger(__name__)


class WeightReceiver(threading.Thread):
    """A generate rank's weight thread: receives every version; keeps the newest pending.

    In `in_flight` mode it loads each version into the engine at once (pause in place, load,
    continue); in `wait` mode the main thread loads the pending version between batches.
    """

    def __init__(self, job: Job, num_versions: int, in_flight: bool):
        super().__init__(name="weight-receiver", daemon=True)
        self.job, self.num_versions, self.in_flight = job, num_versions, in_flight
        self.cond = threading.Condition()
        self.received = 0  # newest version received
        self.loaded = 0  # newest version the engine serves
        self.pending: dict | None = None
        self.loaded_during_generate = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for version in range(1, self.num_versions + 1):
                tensors, _ = broadcast_weights(self.job.groups, {})
                if self.in_flight:
                    load_into_engine(self.job.engine, tensors, version, in_place=True)
                with self.cond:
                    self.received = version
                    if self.in_flight:
                        self.loaded, self.loaded_during_generate = version, True
                    else:
                        self.pending = tensors
                    self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - re-raised by the main thread
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def admit(self, step: int, staleness: StalenessController, timeout_s: float, machine):
        """Block until the engine may generate step `step`; returns (tensors, version) of a
        version to load first (wait mode), or None."""
        required = staleness.required_version(step)
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.received < required and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageTimeout(
                        waiting_for=f"engine weights v{required} (newest received "
                        f"v{self.received})",
                        waited_s=timeout_s,
                        timeout_s=timeout_s,
                        context={"role": "generate", "rank": self.job.rank, "step": step,
                                 **machine.context()},
                    )  # fmt: skip
                self.cond.wait(min(left, 1.0))
            if self.error is not None:
                raise RuntimeError(
                    f"role generate, rank {self.job.rank}: the weight thread failed"
                ) from self.error
            pending, version = self.pending, self.received
            self.pending = None
        if pending is not None:
            return pending, version
        if self.loaded_during_generate:
            self.job.engine.flush_cache()  # KV computed with older weights; engine is idle now
            self.loaded_during_generate = False
        return None

    def load(self, tensors: dict, version: int) -> None:
        """Wait mode: load a received version while the engine is idle between batches."""
        load_into_engine(self.job.engine, tensors, version)
        with self.cond:
            self.loaded = version


def _generate_loop(job: Job, cfg, staleness: StalenessController) -> None:
    sched = cfg.scheduler
    receiver = WeightReceiver(job, cfg.trainer.num_steps, sched.weight_update_mode == "in_flight")
    receiver.start()
    machine = StageMachine(Stage.GENERATE)
    for step in range(cfg.trainer.num_steps):
        timer = StepTimer(rank=job.rank)
        machine.transition(StageState.WAITING_INPUT, f"step {step}: admission")
        with job.stages("admit", step, timer):
            pending = receiver.admit(step, staleness, sched.stage_timeout_s, machine)
        if pending is not None:
            with job.stages("load_weights", step, timer):
                receiver.load(*pending)
        records = job.dataset.next_batch(cfg.rollout.num_prompts_per_step)
        machine.transition(StageState.RUNNING, f"step {step}: engine at v{receiver.loaded}")
        samples, report = job.rollout(step, records, timer)
        machine.transition(StageState.WAITING_OUTPUT_SPACE, f"step {step}: sending samples")
        report.update(timer.metrics(prefix="timing"))
        report.update(machine.metrics())
        exchange_samples(job.groups, samples, report)
        machine.transition(StageState.IDLE, f"step {step}: sent")
    machine.transition(StageState.DONE, "all steps generated")
    receiver.join(timeout=sched.stage_timeout_s)
    if receiver.is_alive():
        raise StageTimeout(
            waiting_for="the weight thread to receive the last version",
            waited_s=sched.stage_timeout_s, timeout_s=sched.stage_timeout_s,
            context={"role": "generate", "rank": job.rank, **machine.context()},
        )  # fmt: skip
    if receiver.error is not None:
        raise RuntimeError(f"role generate, rank {job.rank}: weight thread failed") from (
            receiver.error
        )


def _learn_loop(job: Job, cfg, staleness: StalenessController) -> None:
    last = time.perf_counter()
    for step in range(cfg.trainer.num_steps):
        timer = StepTimer(rank=job.rank)
        job.dataset.next_batch(cfg.rollout.num_prompts_per_step)  # keep the cursor in step
        with job.stages("wait_samples", step, timer):
            samples, gen_reports = exchange_samples(job.groups, [], {})
        report, batch_metrics = job.learn(step, samples, timer)
        batch_metrics.update(staleness.check_batch(step, token_versions(samples)))
        with job.stages("weight_sync", step, timer):
            report.update(sync_weights(job.groups, job.roles, None, version=step + 1))
        report.update(timer.metrics(prefix="timing"))
        now = time.perf_counter()
        job.log_step(step, report, batch_metrics, now - last, gen_reports)
        last = now


def run_grpo_async(cfg, groups, platform) -> None:
    """Train for `trainer.num_steps` steps with generation up to N versions ahead."""
    job = Job(cfg, groups, platform)
    staleness = StalenessController(cfg.scheduler.generate_ahead_steps)
    dist.barrier(group=groups.control)  # engines are up
    try:
        if job.engine is not None:
            if job.roles:
                raise RuntimeError(
                    f"rank {job.rank}: the asynchronous loop needs generate ranks of their own "
                    "(a rank holds generate and Megatron roles)"
                )
            _generate_loop(job, cfg, staleness)
        else:
            _learn_loop(job, cfg, staleness)
        job.write_trace()
    finally:
        job.close()
