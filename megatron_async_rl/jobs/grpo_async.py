"""The asynchronous GRPO loop: generation of the next steps overlaps learning on the current one.

    generate ranks   scheduler thread   dataloader -> generate -> reward -> [scored]   validation
                     main thread        runs the work the scheduler hands out (engine calls)
                     sender thread      [scored] ==samples group==> Megatron ranks
                     weight thread      <==weight_sync group== versions 1, 2, ...; loads them
    Megatron ranks   receiver thread    ==samples group==> [samples]
                     scheduler thread   [samples] -> logp -> ref_logp -> train -> param_update
                     main thread        runs the work (forward, backward, weight sync, metrics)

Owned here: which tasks, queues and threads each rank runs (`scheduler/scheduler.py` steps
them; its docstring has the full diagram and what each stage waits for) and the admission rule.
Called by the entry point when `scheduler.generate_ahead_steps` (N) > 0 or `scheduler.loop:
async`; at N = 0 it matches `jobs/grpo_sync.py`, the reference, bit for bit (tested).

Bounded off-policy: `generate` of step s starts only once the engine holds version s - N or
newer (`scheduler/staleness.py`), and every batch is checked where `train` consumes it, so a
token trained at step k was produced by a version in [k - N, k]. On Megatron ranks `logp` of
step s starts only once the logp role holds version s (its proximal policy is the current one).
Weight updates (`scheduler.weight_update_mode`): `wait` loads a version as soon as the engine is
idle (the generate work holds `engine_lock`); `in_flight` pauses the engine in place, loads and
continues the same requests, whose later tokens then carry the new version.
Validation (`scheduler.validation_every`): when a due version is loaded, the generate ranks
evaluate it before generating more; with `validation_version: exact` the next version is not
loaded before that (the weight thread waits), with `latest` the newest loaded version is used.
Each gloo group is used by one thread per rank, so no two threads share a collective stream.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from megatron_async_rl.jobs.stages import Job, exchange_samples, token_versions
from megatron_async_rl.observability.metrics import StepTimer
from megatron_async_rl.rollout.batch import build_batch
from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.queues import BoundedQueue
from megatron_async_rl.scheduler.scheduler import Scheduler, StageTask
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import Stage, StageState, StageTimeout
from megatron_async_rl.weight_sync.broadcast import (
    broadcast_weights,
    load_into_engine,
    sync_weights,
)

logger = logging.getLogger(__name__)
S = StageState


class WeightReceiver(threading.Thread):
    """A generate rank's weight thread (the `param_update` machine): receives every version and
    loads it into the engine; gates loads on validation of the version before (mode exact)."""

    def __init__(self, job: Job, cfg, wake):
        super().__init__(name="weight-receiver", daemon=True)
        self.job, self.sched, self.wake = job, cfg.scheduler, wake
        self.config = cfg.weight_sync
        self.num_versions = cfg.trainer.num_steps
        self.in_flight = self.sched.weight_update_mode == "in_flight"
        self.machine = StageMachine(Stage.PARAM_UPDATE)
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()  # held while the engine generates
        self.validation_lock = threading.Lock()  # held while the engine validates
        self.loaded = 0  # newest version the engine serves
        self.validated = -1  # newest due version evaluated
        self.validation_open = job.validator is not None
        self.needs_flush = False
        # since the last generate: seconds the engine could not generate because of a load
        # (paused in place, or held idle), and seconds spent receiving (it kept generating)
        self.stats = dict.fromkeys(("weight_sync/stall_s", "timing/weight_sync/receive_s"), 0.0)
        self.error: BaseException | None = None

    def pending_validation(self) -> int | None:
        """The due version to evaluate now with the loaded weights, if any."""
        with self.cond:
            if not self.validation_open:
                return None
            if self.sched.validation_version == "exact":
                due = self.sched.validation_due(self.loaded) and self.loaded > self.validated
                return self.loaded if due else None
            every = self.sched.validation_every
            newest_due = self.loaded - self.loaded % every
            return newest_due if newest_due > self.validated else None

    def mark_validated(self, version: int) -> None:
        with self.cond:
            self.validated = max(self.validated, version)
            self.cond.notify_all()

    def close_validation(self) -> None:
        with self.cond:
            self.validation_open = False
            self.cond.notify_all()

    def _wait_for_validation(self, version: int) -> None:
        """Mode exact: version - 1, if due, is evaluated before `version` replaces it."""
        previous = version - 1
        if self.sched.validation_version != "exact" or not self.sched.validation_due(previous):
            return
        deadline = time.monotonic() + self.sched.stage_timeout_s
        with self.cond:
            while self.validation_open and self.validated < previous:
                if not self.cond.wait(max(deadline - time.monotonic(), 0.0)):
                    raise StageTimeout(
                        f"validation of v{previous} before loading v{version}",
                        self.sched.stage_timeout_s, self.sched.stage_timeout_s,
                        {"role": "generate", "rank": self.job.rank, **self.machine.context()},
                    )  # fmt: skip

    def run(self) -> None:
        machine = self.machine
        try:
            for version in range(1, self.num_versions + 1):
                machine.transition(S.WAITING_INPUT, f"receiving v{version}")
                received = time.perf_counter()
                tensors, _ = broadcast_weights(
                    self.job.groups, {}, self.config, version, self.job.weight_buffers
                )
                received = time.perf_counter() - received  # generation kept running
                machine.transition(S.WAITING_OUTPUT_SPACE, f"engine ready for v{version}")
                self._wait_for_validation(version)
                # wait mode: after the engine's current batch; either mode: never mid-validation
                lock = self.validation_lock if self.in_flight else self.engine_lock
                with lock:
                    machine.transition(S.RUNNING, f"loading v{version}")
                    start, wall_start = time.perf_counter(), time.time()
                    load_into_engine(self.job.engine, tensors, version, in_place=self.in_flight)
                self.job.stages.trace.add("load_weights", wall_start, time.time(), step=version)
                machine.transition(S.IDLE, f"v{version} loaded")
                with self.cond:
                    self.loaded = version
                    self.needs_flush |= self.in_flight
                    self.stats["weight_sync/stall_s"] += time.perf_counter() - start
                    self.stats["timing/weight_sync/receive_s"] += received
                    self.cond.notify_all()
                self.wake()
            machine.transition(S.DONE, "every version loaded")
        except BaseException as err:  # noqa: BLE001 - surfaced by the scheduler's checks
            with self.cond:
                self.error = err
                self.cond.notify_all()
            if not machine.is_terminal:
                machine.fail(err)
            self.wake()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"role generate, rank {self.job.rank}: the weight thread failed: {self.error}"
            ) from self.error


def _thread(name: str, target, errors: list, wake) -> threading.Thread:
    def body():
        try:
            target()
        except BaseException as err:  # noqa: BLE001 - surfaced by the scheduler's checks
            errors.append(err)
            wake()

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


def _raise_first(errors: list, where: str) -> None:
    if errors:
        raise RuntimeError(f"{where}: {errors[0]}") from errors[0]


def _generate_side(job: Job, cfg, staleness: StalenessController) -> None:
    sched, steps = cfg.scheduler, cfg.trainer.num_steps
    timeout = sched.stage_timeout_s
    prompts = BoundedQueue("prompts", sched.queue_capacity)
    rollouts = BoundedQueue("rollouts", sched.queue_capacity)
    scored = BoundedQueue("scored", sched.queue_capacity)
    errors: list[BaseException] = []
    val_reports: list[dict] = []
    receiver = WeightReceiver(job, cfg, wake=lambda: scheduler.wake())

    def load(index):
        records = job.dataset.next_batch(cfg.rollout.num_prompts_per_step)
        return {"step": index, "records": records, "timer": StepTimer(rank=job.rank)}

    def admission(item):
        receiver.check()
        _raise_first(errors, f"role generate, rank {job.rank}: the sender thread failed")
        pending = receiver.pending_validation()
        if pending is not None:
            return f"validation of v{pending}"
        required = staleness.required_version(item["step"])
        if receiver.loaded < required:
            return f"engine weights v{required} (engine serves v{receiver.loaded})"
        return None

    def generate(item):
        step, timer = item["step"], item["timer"]
        with receiver.cond:
            flush, receiver.needs_flush = receiver.needs_flush, False
            item["weight_sync"] = dict(receiver.stats)
            receiver.stats = dict.fromkeys(receiver.stats, 0.0)
        with receiver.engine_lock:
            if flush:  # KV computed with older weights; the engine is idle now
                job.engine.flush_cache()
            item["samples"] = job.generate(step, item["records"], timer)
        return item

    def score(item):
        samples, report = job.score(item["step"], item["samples"], item["timer"])
        report.update(item["weight_sync"])
        while val_reports:
            report.update(val_reports.pop(0))
        report.update(item["timer"].metrics(prefix="timing"))
        report.update(scheduler.metrics())
        report.update(job.stages.utilization())
        return samples, report

    def validation_guard(_):
        pending = receiver.pending_validation()
        return None if pending is not None else "a due version to be loaded"

    def validate(_):
        due = receiver.pending_validation()
        with receiver.engine_lock, receiver.validation_lock:
            version = receiver.loaded  # exact: the due version; latest: the newest loaded
            report = job.validate(version, version, StepTimer(rank=job.rank))
        val_reports.append({**report, "val/due_version": float(due)})
        receiver.mark_validated(due)

    def send():
        for _ in range(steps):
            samples, report = scored.get(timeout, {"role": "generate", "rank": job.rank})
            exchange_samples(job.groups, samples, report)

    generate_machine = StageMachine(Stage.GENERATE)
    tasks = [
        StageTask(StageMachine(Stage.DATALOADER), load, output=prompts, num_items=steps),
        StageTask(generate_machine, generate, inputs=prompts, output=rollouts, guard=admission),
        StageTask(StageMachine(Stage.REWARD), score, inputs=rollouts, output=scored),
    ]
    if job.validator is not None:
        tasks.append(StageTask(
            job.validation_machine, validate, guard=validation_guard,
            done_when=lambda: generate_machine.is_terminal,
        ))  # fmt: skip
    scheduler = Scheduler(tasks, role="generate", rank=job.rank, timeout_s=timeout)
    receiver.start()
    sender = _thread("samples-sender", send, errors, scheduler.wake)
    try:
        scheduler.run()
    finally:
        receiver.close_validation()
    _join(sender, timeout, "the sender thread to hand over the last samples", job)
    _raise_first(errors, f"role generate, rank {job.rank}: the sender thread failed")
    _join(receiver, timeout, "the weight thread to receive the last version", job)
    receiver.check()


def _join(thread: threading.Thread, timeout: float, waiting_for: str, job: Job) -> None:
    thread.join(timeout=timeout)
    if thread.is_alive():
        raise StageTimeout(waiting_for, timeout, timeout, {"role": "generate", "rank": job.rank})


def _learn_side(job: Job, cfg, staleness: StalenessController) -> None:
    sched, steps = cfg.scheduler, cfg.trainer.num_steps
    timeout, capacity = sched.stage_timeout_s, sched.queue_capacity
    role = "+".join(job.groups.local_roles())
    samples_q, logp_q, ref_q, trained_q = (
        BoundedQueue(name, capacity) for name in ("samples", "logp", "ref", "trained")
    )
    errors: list[BaseException] = []
    state = {"logp_version": 0, "last": time.perf_counter()}

    def receive():
        for step in range(steps):
            timer = StepTimer(rank=job.rank)
            with job.stages("wait_samples", step, timer):
                samples, gen_reports = exchange_samples(job.groups, [], {})
            samples_q.put(
                {"step": step, "samples": samples, "gen_reports": gen_reports, "timer": timer},
                timeout, {"role": role, "rank": job.rank, "stage": "receive"},
            )  # fmt: skip
            scheduler.wake()
        samples_q.close()  # the stages downstream finish once they drained it

    def logp_guard(item):
        _raise_first(errors, f"role {role}, rank {job.rank}: the receiver thread failed")
        if "logp" in job.roles and state["logp_version"] < item["step"]:
            return f"logp weights v{item['step']} (logp holds v{state['logp_version']})"
        return None

    def logp(item):
        job.dataset.next_batch(cfg.rollout.num_prompts_per_step)  # keep the cursor in step
        item.update(batch=build_batch(item["samples"], job.pad_id), results={})
        return job.forward("logp", item)

    def train(item):
        report, batch_metrics = job.train(item)
        batch_metrics.update(staleness.check_batch(item["step"], token_versions(item["samples"])))
        item.update(report=report, batch_metrics=batch_metrics)
        return item

    def param_update(item):
        step, timer, report = item["step"], item["timer"], item["report"]
        with job.stages("weight_sync", step, timer):
            report.update(
                sync_weights(
                    job.groups, job.roles, None, step + 1, cfg.weight_sync, job.weight_buffers
                )
            )
        state["logp_version"] = step + 1
        report.update(timer.metrics(prefix="timing"))
        report.update(scheduler.metrics())
        now = time.perf_counter()
        job.log_step(step, report, item["batch_metrics"], now - state["last"], item["gen_reports"])
        state["last"] = now

    tasks = [
        StageTask(StageMachine(Stage.LOGP), logp, inputs=samples_q, output=logp_q,
                  guard=logp_guard),
        StageTask(StageMachine(Stage.REF_LOGP), lambda item: job.forward("ref", item),
                  inputs=logp_q, output=ref_q),
        StageTask(StageMachine(Stage.TRAIN), train, inputs=ref_q, output=trained_q),
        StageTask(StageMachine(Stage.PARAM_UPDATE), param_update, inputs=trained_q),
    ]  # fmt: skip
    scheduler = Scheduler(tasks, role=role, rank=job.rank, timeout_s=timeout)
    receiver = _thread("samples-receiver", receive, errors, scheduler.wake)
    try:
        scheduler.run()
    finally:
        samples_q.close()
    receiver.join(timeout=timeout)
    _raise_first(errors, f"role {role}, rank {job.rank}: the receiver thread failed")


def run_grpo_async(cfg, groups, platform) -> None:
    """Train for `trainer.num_steps` steps with generation up to N versions ahead."""
    job = Job(cfg, groups, platform)
    staleness = StalenessController(cfg.scheduler.generate_ahead_steps)
    dist.barrier(group=groups.control)  # engines are up
    try:
        if groups.layout.is_engine_follower(job.rank):
            pass  # its host's engine uses this rank's devices; it only joins the end of run
        elif job.engine is not None:
            if job.roles:
                raise RuntimeError(
                    f"rank {job.rank}: the asynchronous loop needs generate ranks of their own "
                    "(a rank holds generate and Megatron roles)"
                )
            _generate_side(job, cfg, staleness)
        else:
            _learn_side(job, cfg, staleness)
        job.write_trace()
    finally:
        job.close()
