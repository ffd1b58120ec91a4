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
Weight updates (`scheduler.weight_update_mode`): `wait` loads a received version as soon as the
engine finishes its current batch (off the generate rank's critical path while it hands its
samples over); `in_flight` pauses the engine in place, loads, and continues the same requests,
whose later tokens then carry the new version.

The Megatron ranks run the same step body as the synchronous loop (`jobs/stages.py`); only the
generate ranks change. Each gloo group is used by one thread per rank (samples: main thread;
weight_sync: the weight thread), so the two directions never wait on each other.
"""

from __future__ import annotations

import contextlib
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
    """A generate rank's weight thread: receives every version and loads it into the engine.

    `wait` mode: a version is loaded as soon as the engine is idle; `engine_lock` is held by
    the main thread while it generates, so a load waits for the current batch and usually
    lands while the main thread hands its samples over. `in_flight` mode: the version is
    loaded at once, the engine paused in place around the load.
    """

    def __init__(self, job: Job, num_versions: int, in_flight: bool):
        super().__init__(name="weight-receiver", daemon=True)
        self.job, self.num_versions, self.in_flight = job, num_versions, in_flight
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()
        self.loaded = 0  # newest version the engine serves
        self.loaded_during_generate = False
        self.load_s = 0.0  # seconds spent loading since the last admission
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for version in range(1, self.num_versions + 1):
                tensors, _ = broadcast_weights(self.job.groups, {})
                lock = contextlib.nullcontext() if self.in_flight else self.engine_lock
                with lock:  # wait mode: after the engine's current batch
                    start, wall_start = time.perf_counter(), time.time()
                    load_into_engine(self.job.engine, tensors, version, in_place=self.in_flight)
                self.job.stages.trace.add("load_weights", wall_start, time.time(), step=version)
                with self.cond:
                    self.loaded = version
                    self.loaded_during_generate |= self.in_flight
                    self.load_s += time.perf_counter() - start
                    self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - re-raised by the main thread
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def admit(self, step: int, staleness: StalenessController, timeout_s: float, machine) -> float:
        """Block until the engine holds a version that may generate step `step`.

        Returns the seconds the weight thread spent loading since the previous admission.
        """
        required = staleness.required_version(step)
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.loaded < required and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageTimeout(
                        waiting_for=f"engine weights v{required} (engine serves v{self.loaded})",
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
            flush, self.loaded_during_generate = self.loaded_during_generate, False
            load_s, self.load_s = self.load_s, 0.0
        if flush:
            self.job.engine.flush_cache()  # KV computed with older weights; engine is idle now
        return load_s


def _generate_loop(job: Job, cfg, staleness: StalenessController) -> None:
    sched = cfg.scheduler
    receiver = WeightReceiver(job, cfg.trainer.num_steps, sched.weight_update_mode == "in_flight")
    receiver.start()
    machine = StageMachine(Stage.GENERATE)
    for step in range(cfg.trainer.num_steps):
        timer = StepTimer(rank=job.rank)
        machine.transition(StageState.WAITING_INPUT, f"step {step}: admission")
        with job.stages("admit", step, timer):
            load_s = receiver.admit(step, staleness, sched.stage_timeout_s, machine)
        records = job.dataset.next_batch(cfg.rollout.num_prompts_per_step)
        machine.transition(StageState.RUNNING, f"step {step}: engine at v{receiver.loaded}")
        with receiver.engine_lock:
            samples, report = job.rollout(step, records, timer)
        report["timing/load_weights_s"] = load_s
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
