"""An engine host's side of the asynchronous loop: `GeneratePipeline`.

    dataloader -> generate -> reward ==send==>         (validation when due, checkpoint saves)
                     ^ admission: engine holds v >= s - N
    weight thread: <==weights== receive v, load        (`jobs/weight_thread.py`)

Owned here: the engine host's stages and guards, as methods of `GeneratePipeline`, over the
generate side's methods (`roles/generate.py`), the queues between them, and the threads that
run beside its scheduler: the samples sender (through the exchange, `jobs/exchange.py`), the
weight thread, and with checkpoints the `Boundaries` thread (`jobs/async_checkpoint.py`). Built
by `jobs/grpo_async.py:run_grpo_async` on an engine host's gloo rank, and by the unit tests on a
`LocalExchange`. Everything a method reads is built in the constructor; `run()` starts the
threads, runs the scheduler and waits for the threads.

Checkpoints: the host records its untrained steps in `PendingSteps` and saves them in its
`checkpoint` stage; a resumed host starts with them (`Resumed`), each step back in the queue of
the stage it had reached (`PLACED`).

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

import time

from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.checkpoint.pending import GENERATED, LOADED, PARTIAL, SCORED, PendingSteps
from megatron_async_rl.engines.protocol import ManagedEngine
from megatron_async_rl.engines.recovery import prefixes
from megatron_async_rl.jobs.async_checkpoint import Boundaries, Resumed
from megatron_async_rl.jobs.grpo_sync import running
from megatron_async_rl.jobs.weight_thread import EngineGate, WeightReceiver
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.rollout.generation import as_result
from megatron_async_rl.scheduler.queues import BoundedQueue
from megatron_async_rl.scheduler.scheduler import HelperThread, Scheduler, StageTask
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import Stage, StageTimeout

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


class GeneratePipeline:
    """An engine host's stages, guards, queues and threads, from step `start` with what a
    checkpoint kept (`resumed`); `run()` until every step's samples are sent and every version
    is loaded."""

    def __init__(self, gen, exchange, clock: RankClock, cfg, rank: int, checkpoints=None,
                 start: int = 0, resumed: Resumed | None = None):  # fmt: skip
        sched = cfg.scheduler
        self.gen, self.exchange, self.clock, self.sched = gen, exchange, clock, sched
        self.checkpoints, self.start, self.steps = checkpoints, start, cfg.trainer.num_steps
        self.timeout = sched.stage_timeout_s
        self.staleness = StalenessController(sched.generate_ahead_steps)
        self.who, self.context = f"role generate, rank {rank}", {"role": "generate", "rank": rank}
        self.resumed = resumed or Resumed()
        self.pending = PendingSteps()

        # Resumed steps back in their queues (a queue holds at least what goes back to it).
        kept = self.resumed.steps(start)
        placed = [(stage, work, _queue_of(stage, work)) for stage, _ in PLACED
                  for work in kept[stage]]  # fmt: skip
        queues = {name: BoundedQueue(name, max(sched.queue_capacity,
                                               sum(q == name for *_, q in placed)))
                  for name in ("prompts", "rollouts", "judged", "scored")}  # fmt: skip
        self.prompts, self.rollouts = queues["prompts"], queues["rollouts"]
        self.judged, self.scored = queues["judged"], queues["scored"]
        for stage, work, name in placed:
            queues[name].put(self.pending.record(work, stage), self.timeout, self.context)
        self.resumed.metrics.update(_stale_prefixes(kept[PARTIAL], self.staleness))

        generate_machine = clock.machine(Stage.GENERATE)
        validation_machine = clock.machine(Stage.VALIDATION)
        in_flight = sched.weight_update_mode == "in_flight"
        self.gate = EngineGate(gen.engine, generate_machine, in_flight, sched.in_flight_pause)
        if isinstance(gen.engine, ManagedEngine) and gen.engine.board is not None:
            # Other engines' jobs are batches of this engine's users too.
            gen.engine.help_gate = lambda: self.gate.generating(stage=False)
        self.validations: dict[int, dict] = dict(self.resumed.validations)
        """Validation reports by due version; version s is reported with step s, as in the
        synchronous loop (in mode latest a due version may be skipped by a newer one)."""
        self.last_due = max((v for v in range(self.steps) if sched.validation_due(v)),
                            default=-1)  # fmt: skip
        self.saves = BoundedQueue("saves", 1)

        # The threads come last (each wakes the scheduler); the stages and guards read them
        # only once `run()` has started them.
        tasks = self._tasks(cfg, generate_machine, validation_machine, placed)
        self.scheduler = Scheduler(tasks, role="generate", rank=rank, timeout_s=self.timeout)
        self.receiver = WeightReceiver(
            exchange, self.gate, clock.machine(Stage.PARAM_UPDATE), sched, self.steps,
            gen.validator is not None, rank, wake=self.scheduler.wake, loaded=start,
            validated=self.resumed.validated,
        )  # fmt: skip
        self.boundaries = Boundaries(
            checkpoints, start, self.steps, self.pending, self.saves, self.scheduler.wake,
            getattr(exchange, "device", None), cut=gen.cut,
        )  # fmt: skip
        self.sender = HelperThread("samples-sender", self.send, self.scheduler.wake)

    def _tasks(self, cfg, generate_machine, validation_machine, placed) -> list[StageTask]:
        """The scheduler's tasks, upstream first; with refill, the first round of the step
        after the resumed ones is drawn here (before the scheduler starts)."""
        clock, steps = self.clock, self.steps
        loader_machine = clock.machine(Stage.DATALOADER)
        generating = StageTask(generate_machine, self.generate, inputs=self.prompts,
                               output=self.rollouts, guard=self.admission)  # fmt: skip
        if cfg.algorithm.refill:
            tasks = [
                generating,
                StageTask(clock.machine(Stage.REWARD), self.score, inputs=self.rollouts,
                          output=self.judged),
                StageTask(loader_machine, self.settle, inputs=self.judged, output=self.scored,
                          guard=self.settled),
            ]  # fmt: skip
            if all(name == "scored" for *_, name in placed):  # no step is being refilled
                last = max((work.step for _, work, _ in placed), default=self.start - 1)
                if last + 1 < steps:
                    with running(loader_machine, last + 1, "next prompts"):
                        self.load_after(last)
                else:
                    self.prompts.close()
        else:
            loader = StageTask(loader_machine, self.load, output=self.prompts, num_items=steps)
            loader.produced = self.start + len(placed)  # the next step to load
            tasks = [
                loader,
                generating,
                StageTask(clock.machine(Stage.REWARD), self.score, inputs=self.rollouts,
                          output=self.scored),
            ]  # fmt: skip
        if self.gen.validator is not None:
            tasks.append(StageTask(validation_machine, self.validate, guard=self.validation_due,
                                   done_when=self.validated_all))  # fmt: skip
        if self.checkpoints is not None:  # last: a due save goes before any other work
            tasks.append(StageTask(clock.machine(Stage.CHECKPOINT), self.save,
                                   inputs=self.saves, guard=self.save_due))  # fmt: skip
        return tasks

    def run(self) -> None:
        """Start the threads, run every stage to the end, then wait for the threads."""
        timeout, context = self.timeout, self.context
        self.receiver.start()
        self.sender.start()
        if self.checkpoints is not None:
            self.boundaries.start()
        try:
            self.scheduler.run()
        except Preempted:
            raise  # every rank stops at the same boundary: the threads' peers are gone
        finally:
            self.receiver.close_validation()
        self.sender.finish(timeout, "the sender thread to hand over the last samples", context)
        self.sender.check(self.who)
        self.receiver.join(timeout=timeout)
        if self.receiver.is_alive():
            raise StageTimeout("the weight thread to receive the last version", timeout, timeout,
                               context)  # fmt: skip
        self.receiver.check()
        if self.checkpoints is not None:
            self.boundaries.finish(timeout, context)

    # -- stages (the scheduler's main thread) ------------------------------------------------
    def load(self, step: int) -> StepWork:
        return self.pending.record(self.gen.load(step), LOADED)

    def generate(self, work: StepWork) -> StepWork:
        gen = self.gen
        if gen.faults is not None:
            gen.faults.at_step(work.step)
        while True:
            with self.gate.generating():
                work = gen.generate(work)
            if not work.partial:
                return self.pending.record(work, GENERATED)
            # Cut by the boundaries thread for a due save: save the prefixes now (a signal
            # stops the run here), then go on from them.
            self.pending.record(work, PARTIAL)
            self.save_now()

    def score(self, work: StepWork) -> StepWork:
        return self.pending.record(self.gen.score(work), SCORED)

    def settle(self, work: StepWork) -> StepWork | None:
        """Refill: the round decided; the complete batch goes on, a short one back to generate
        with its next round."""
        if not self.gen.settle(work, self.gen.round_flags(work)):
            put = self.prompts.try_put(self.pending.record(work, LOADED))
            assert put, "refill: the prompts queue holds another step while one is refilled"
            return None
        self.pending.record(work, SCORED)
        self.load_after(work.step)
        return work

    def load_after(self, step: int) -> None:
        """Refill: step `step + 1`'s first round, drawn once step `step` is complete (the
        prompts queue holds no other step then), or the end of the prompts."""
        if step + 1 >= self.steps:
            self.prompts.close()
            return
        put = self.prompts.try_put(self.pending.record(self.gen.load(step + 1), LOADED))
        assert put, "refill: the prompts queue holds another step while one is refilled"

    def validate(self, _) -> None:
        due = self.receiver.pending_validation()
        with self.gate.validating():
            version = self.receiver.loaded  # exact: the due version; latest: the newest loaded
            self.validations[due] = {**self.gen.validate(version), "val/due_version": float(due)}
        self.receiver.mark_validated(due)

    def save(self, version: int) -> None:
        """The engine host's part of checkpoint `version` (its data, between two works)."""
        extra = {"validated": self.receiver.validated, "validations": self.validations}
        self.checkpoints.save(version, self.gen, None, self.pending, extra)
        self.boundaries.saved(version)

    def save_now(self) -> None:
        """The due save, from the generate stage whose generation was cut for it."""
        timeout, context = self.timeout, self.context
        version = self.saves.get(timeout, context)
        deadline = time.monotonic() + timeout
        while (waiting := self.save_due(version)) is not None:  # the weight thread loads it
            self.receiver.check()
            if time.monotonic() > deadline:
                raise StageTimeout(waiting, timeout, timeout, context)
            time.sleep(0.01)
        self.save(version)

    # -- guards (the scheduler thread): what a task still waits for, None when nothing -------
    def admission(self, work: StepWork) -> str | None:
        self.receiver.check()
        self.sender.check(self.who)
        due = self.receiver.pending_validation()
        if due is not None:
            return f"validation of v{due}"
        required = self.staleness.required_version(work.step)
        if self.receiver.loaded < required:
            return f"engine weights v{required} (engine serves v{self.receiver.loaded})"
        return None

    def settled(self, work: StepWork) -> str | None:
        self.receiver.check()
        self.sender.check(self.who)
        if self.gen.round_flags(work) is None:
            return f"the engine hosts' refill flags of step {work.step} round {work.refill.rounds}"
        return None

    def validation_due(self, _) -> str | None:
        return None if self.receiver.pending_validation() is not None else "a due version loaded"

    def validated_all(self) -> bool:
        return self.receiver.validated >= self.last_due

    def save_due(self, version: int) -> str | None:
        return None if self.receiver.loaded >= version else f"engine weights v{version} to save"

    # -- the sender thread -------------------------------------------------------------------
    def send(self) -> None:
        """Each scored step, its report completed, through the exchange in step order."""
        gen, receiver, clock = self.gen, self.receiver, self.clock
        for _ in range(self.start, self.steps):
            # No timeout of its own: the scheduler times out whatever stalls upstream, and closes
            # this queue when it stops.
            work = self.scored.get(None, self.context)
            report = work.report
            if gen.validator is not None and self.sched.validation_due(work.step):
                receiver.wait_validated(work.step)  # the learner needs v_s first anyway
                report.add_means(self.validations.pop(work.step, {}))
            with self.pending.lock:  # a checkpoint may be writing this step's report
                if work.step == self.start:
                    report.add_sums(self.resumed.metrics)
                report.add_measured(receiver.take_stats())
                report.add_maxima(clock.timings(work.step, GENERATE_STAGES))
                report.add_maxima(clock.timings(None, (Stage.VALIDATION,)))
                report.add_means(self.scheduler.metrics())
                report.add_means(clock.utilization())
            self.exchange.send_step(work)


def _stale_prefixes(works: list[StepWork], staleness: StalenessController) -> dict[str, float]:
    """`resume/tokens_regenerated`: tokens of restored prefixes now older than their step's
    window (the generate stage generates them again)."""
    dropped = sum(
        prefixes.kept_prefix(as_result(sample, work.step), staleness.window(work.step)[0])[1]
        for work in works
        for sample in work.samples or []
    )
    return {"resume/tokens_regenerated": float(dropped)} if dropped else {}
