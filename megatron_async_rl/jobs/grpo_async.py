"""The asynchronous GRPO loop: generation runs up to N policy versions ahead of training.

    engine host:  dataloader -> generate -> reward ==send==>            (validation when due)
                                  ^ admission: engine holds v >= s - N
                  weight thread: <==weights== receive v, load (wait: between batches;
                                                              in_flight: paused in place)
    Megatron:     ==receive==> logp -> ref_logp -> train -> param_update (sync v = s + 1, log)
                                ^ logp holds v_s
                  (PPO: ... ref_logp -> [reward_model] -> critic_values -> train -> critic_train
                   -> param_update; critic_values waits for the critic trained through s - 1)

Owned here: the two pipelines as declarative lists of `StageTask`s over the sides' methods
(`roles/generate.py`, `roles/learn.py`), the threads that move samples and weights through the
exchange (`jobs/exchange.py`), and the admission and validation guards. The staleness rule is
`scheduler/staleness.py`; the engine's users and the weight thread are `jobs/weight_thread.py`.
`run_generate_pipeline` and `run_learn_pipeline` take any `Exchange`: on gloo ranks from the
entry point (`run_grpo_async`), or both in one process on a `LocalExchange` in unit tests.
Checkpoints: every rank meets the others at the boundary after each version (`boundary`, and
an engine host's `Boundaries` thread); an engine host records its untrained steps in
`PendingSteps` and saves them in its `checkpoint` stage; a resumed host starts with them
(`Resumed`): `jobs/async_checkpoint.py`.

Refill (`algorithm.refill`, `rollout/refill.py`): the reward stage hands each scored round to
the dataloader stage, which settles it once every engine host's flags of the round are in
(a guard: the scheduler thread waits, the main thread stays free for saves), then sends the
step's completed batch on, or puts the work back to the generate stage with the next round's
prompts. The next step's first round is drawn only once the step before is complete, so a step's
prompts are contiguous in the data and every run draws the same ones whatever the timing. Every
round passes the generate stage's admission for its step, so each sampled group, kept or
dropped, was generated within the step's staleness window.

    dataloader(settle) --[prompts]--> generate --[rollouts]--> reward --[judged]--+
        ^  |  (short: the next round, same step)                                  |
        |  +--(complete)--> [scored] ==send==>                                    |
        +-------------------------------------------------------------------------+
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.checkpoint.manager import CheckpointManager
from megatron_async_rl.checkpoint.pending import GENERATED, LOADED, PARTIAL, SCORED, PendingSteps
from megatron_async_rl.distributed.collective_errors import name_failure
from megatron_async_rl.engines import prefixes
from megatron_async_rl.jobs.async_checkpoint import Boundaries, Resumed
from megatron_async_rl.jobs.grpo_sync import boundary, learn_stages, running, stage_method
from megatron_async_rl.jobs.parts import build_parts
from megatron_async_rl.jobs.weight_thread import EngineGate, WeightReceiver
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.observability.logs import leader_print
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.rollout.generation import as_result
from megatron_async_rl.scheduler.queues import BoundedQueue
from megatron_async_rl.scheduler.scheduler import Scheduler, StageTask
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import Stage, StageTimeout

logger = logging.getLogger(__name__)
GENERATE_STAGES = (Stage.DATALOADER, Stage.GENERATE, Stage.REWARD, Stage.CHECKPOINT)
PLACED = ((PARTIAL, "prompts"), (LOADED, "prompts"), (GENERATED, "rollouts"), (SCORED, "scored"))
"""Where a resumed step goes back by the stage it had reached (`PendingSteps`); a partial step
(its generation cut for the save) goes back to the generate stage, which continues it from its
prefixes."""


def _queue_of(stage: str, work: StepWork) -> str:
    """The queue a resumed `work` goes back to: refill's scored round not yet settled goes to
    the dataloader stage that settles it (`judged`)."""
    name = dict(PLACED)[stage]
    if name == "scored" and work.refill is not None and not work.refill.done:
        return "judged"
    return name


class _Thread(threading.Thread):
    """A helper thread whose error the scheduler's guards re-raise."""

    def __init__(self, name: str, target, wake):
        super().__init__(name=name, daemon=True)
        self.target, self.wake, self.error = target, wake, None

    def run(self) -> None:
        try:
            self.target()
        except BaseException as err:  # noqa: BLE001 - surfaced by the scheduler's checks
            self.error = name_failure(err, {"stage": self.name})
            self.wake()

    def check(self, who: str) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"{who}: the {self.name} thread failed: {self.error}"
            ) from self.error

    def finish(self, timeout: float, waiting_for: str, context: dict) -> None:
        self.join(timeout=timeout)
        if self.is_alive():
            raise StageTimeout(waiting_for, timeout, timeout, context)


def run_generate_pipeline(
    gen, exchange, clock: RankClock, cfg, rank: int, checkpoints=None, start: int = 0,
    resumed: Resumed | None = None,
) -> None:  # fmt: skip
    """An engine host's side of the asynchronous loop, until every step's samples are sent and
    every version is loaded; from step `start` with what a checkpoint kept (`resumed`)."""
    sched, steps = cfg.scheduler, cfg.trainer.num_steps
    timeout, capacity = sched.stage_timeout_s, sched.queue_capacity
    staleness = StalenessController(sched.generate_ahead_steps)
    who, context = f"role generate, rank {rank}", {"role": "generate", "rank": rank}
    resumed = resumed or Resumed()
    pending = PendingSteps()
    kept = resumed.steps(start)
    placed = [(stage, work, _queue_of(stage, work)) for stage, _ in PLACED for work in kept[stage]]
    queues = {name: BoundedQueue(name, max(capacity, sum(q == name for *_, q in placed)))
              for name in ("prompts", "rollouts", "judged", "scored")}  # fmt: skip
    prompts, rollouts, scored = queues["prompts"], queues["rollouts"], queues["scored"]
    for stage, work, name in placed:
        queues[name].put(pending.record(work, stage), timeout, context)
    resumed.metrics.update(_stale_prefixes(kept[PARTIAL], staleness))
    generate_machine = clock.machine(Stage.GENERATE)
    validation_machine = clock.machine(Stage.VALIDATION)
    in_flight = sched.weight_update_mode == "in_flight"
    gate = EngineGate(gen.engine, generate_machine, in_flight, sched.in_flight_pause)
    if getattr(gen.engine, "board", None) is not None:  # other engines' jobs: batches too
        gen.engine.help_gate = lambda: gate.generating(stage=False)
    receiver = WeightReceiver(
        exchange, gate, clock.machine(Stage.PARAM_UPDATE), sched, steps,
        gen.validator is not None, rank, wake=lambda: scheduler.wake(), loaded=start,
        validated=resumed.validated,
    )  # fmt: skip
    validations: dict[int, dict] = dict(resumed.validations)
    """Validation reports by due version; version s is reported with step s, as in the
    synchronous loop (in mode latest a due version may be skipped by a newer one)."""
    last_due = max((v for v in range(steps) if sched.validation_due(v)), default=-1)

    def admission(work: StepWork) -> str | None:
        receiver.check()
        sender.check(who)
        due = receiver.pending_validation()
        if due is not None:
            return f"validation of v{due}"
        required = staleness.required_version(work.step)
        if receiver.loaded < required:
            return f"engine weights v{required} (engine serves v{receiver.loaded})"
        return None

    def load(step: int) -> StepWork:
        return pending.record(gen.load(step), LOADED)

    def generate(work: StepWork) -> StepWork:
        if gen.faults is not None:
            gen.faults.at_step(work.step)
        while True:
            with gate.generating():
                work = gen.generate(work)
            if not work.partial:
                return pending.record(work, GENERATED)
            # Cut by the boundaries thread for a due save: save the prefixes now (a signal
            # stops the run here), then go on from them.
            pending.record(work, PARTIAL)
            save_now()

    def score(work: StepWork) -> StepWork:
        return pending.record(gen.score(work), SCORED)

    def settled(work: StepWork) -> str | None:
        receiver.check()
        sender.check(who)
        if gen.round_flags(work) is None:
            return f"the engine hosts' refill flags of step {work.step} round {work.refill.rounds}"
        return None

    def settle(work: StepWork) -> StepWork | None:
        """Refill: the round decided; the complete batch goes on, a short one back to generate
        with its next round."""
        if not gen.settle(work, gen.round_flags(work)):
            put = prompts.try_put(pending.record(work, LOADED))
            assert put, "refill: the prompts queue holds another step while one is refilled"
            return None
        pending.record(work, SCORED)
        load_after(work.step)
        return work

    def load_after(step: int) -> None:
        """Refill: step `step + 1`'s first round, drawn once step `step` is complete (the
        prompts queue holds no other step then), or the end of the prompts."""
        if step + 1 >= steps:
            prompts.close()
            return
        put = prompts.try_put(pending.record(gen.load(step + 1), LOADED))
        assert put, "refill: the prompts queue holds another step while one is refilled"

    def validation_due(_) -> str | None:
        return None if receiver.pending_validation() is not None else "a due version loaded"

    def validate(_) -> None:
        due = receiver.pending_validation()
        with gate.validating():
            version = receiver.loaded  # exact: the due version; latest: the newest loaded
            validations[due] = {**gen.validate(version), "val/due_version": float(due)}
        receiver.mark_validated(due)

    def send() -> None:
        for _ in range(start, steps):
            # No timeout of its own: the scheduler times out whatever stalls upstream, and closes
            # this queue when it stops.
            work = scored.get(None, context)
            report = work.report
            if gen.validator is not None and sched.validation_due(work.step):
                receiver.wait_validated(work.step)  # the learner needs v_s first anyway
                report.add_means(validations.pop(work.step, {}))
            with pending.lock:  # a checkpoint may be writing this step's report
                if work.step == start:
                    report.add_sums(resumed.metrics)
                report.add_measured(receiver.take_stats())
                report.add_maxima(clock.timings(work.step, GENERATE_STAGES))
                report.add_maxima(clock.timings(None, (Stage.VALIDATION,)))
                report.add_means(scheduler.metrics())
                report.add_means(clock.utilization())
            exchange.send_step(work)

    saves = BoundedQueue("saves", 1)
    boundaries = Boundaries(checkpoints, start, steps, pending, saves, lambda: scheduler.wake(),
                            getattr(exchange, "device", None), cut=gen.cut)  # fmt: skip

    def save_due(version: int) -> str | None:
        return None if receiver.loaded >= version else f"engine weights v{version} to save"

    def save_now() -> None:
        """The due save, from the generate stage whose generation was cut for it."""
        version = saves.get(timeout, context)
        deadline = time.monotonic() + timeout
        while (waiting := save_due(version)) is not None:  # the weight thread loads it
            receiver.check()
            if time.monotonic() > deadline:
                raise StageTimeout(waiting, timeout, timeout, context)
            time.sleep(0.01)
        save(version)

    def save(version: int) -> None:
        """The engine host's part of checkpoint `version` (its data, between two works)."""
        extra = {"validated": receiver.validated, "validations": validations}
        checkpoints.save(version, gen, None, pending, extra)
        boundaries.saved(version)

    loader_machine = clock.machine(Stage.DATALOADER)
    generating = StageTask(generate_machine, generate, inputs=prompts, output=rollouts,
                           guard=admission)  # fmt: skip
    if cfg.algorithm.refill:
        judged = queues["judged"]
        tasks = [
            generating,
            StageTask(clock.machine(Stage.REWARD), score, inputs=rollouts, output=judged),
            StageTask(loader_machine, settle, inputs=judged, output=scored, guard=settled),
        ]
        if all(name == "scored" for *_, name in placed):  # no step is being refilled
            last = max((work.step for _, work, _ in placed), default=start - 1)
            if last + 1 < steps:
                with running(loader_machine, last + 1, "next prompts"):
                    load_after(last)
            else:
                prompts.close()
    else:
        loader = StageTask(loader_machine, load, output=prompts, num_items=steps)
        loader.produced = start + len(placed)  # the next step to load
        tasks = [
            loader,
            generating,
            StageTask(clock.machine(Stage.REWARD), score, inputs=rollouts, output=scored),
        ]
    if gen.validator is not None:
        tasks.append(StageTask(validation_machine, validate, guard=validation_due,
                               done_when=lambda: receiver.validated >= last_due))  # fmt: skip
    if checkpoints is not None:  # last: a due save goes before any other work
        tasks.append(StageTask(clock.machine(Stage.CHECKPOINT), save, inputs=saves,
                               guard=save_due))  # fmt: skip
    scheduler = Scheduler(tasks, role="generate", rank=rank, timeout_s=timeout)
    sender = _Thread("samples-sender", send, scheduler.wake)
    receiver.start()
    sender.start()
    if checkpoints is not None:
        boundaries.start()
    try:
        scheduler.run()
    except Preempted:
        raise  # every rank stops at the same boundary: the threads' peers are gone
    finally:
        receiver.close_validation()
    sender.finish(timeout, "the sender thread to hand over the last samples", context)
    sender.check(who)
    receiver.join(timeout=timeout)
    if receiver.is_alive():
        raise StageTimeout("the weight thread to receive the last version", timeout, timeout,
                           context)  # fmt: skip
    receiver.check()
    if checkpoints is not None:
        boundaries.finish(timeout, context)


def _stale_prefixes(works: list[StepWork], staleness: StalenessController) -> dict[str, float]:
    """`resume/tokens_regenerated`: tokens of restored prefixes now older than their step's
    window (the generate stage generates them again)."""
    dropped = sum(
        prefixes.kept_prefix(as_result(sample, work.step), staleness.window(work.step)[0])[1]
        for work in works
        for sample in work.samples or []
    )
    return {"resume/tokens_regenerated": float(dropped)} if dropped else {}


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

    works = {stage: stage_method(learn, stage) for stage in chain}
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
    receiver = _Thread("samples-receiver", receive, scheduler.wake)
    receiver.start()
    try:
        scheduler.run()
    except Preempted:
        raise  # every rank stops at the same boundary: the receiver's peers are gone
    finally:
        samples_q.close()
    receiver.join(timeout=timeout)
    receiver.check(who)


def run_grpo_async(cfg, groups, platform) -> None:
    """Train for `trainer.num_steps` steps with generation up to N versions ahead; resumes
    from and saves checkpoints like the synchronous loop (collective over the world)."""
    checkpoints = CheckpointManager(cfg, groups)
    checkpoints.choose()  # a checkpoint of another recipe stops the run before engines start
    parts = build_parts(cfg, groups, platform)
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
                run_generate_pipeline(parts.gen, parts.exchange, parts.clock, cfg, rank,
                                      checkpoints, start, resumed)  # fmt: skip
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
