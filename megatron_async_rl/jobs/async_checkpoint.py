"""Checkpoints in the asynchronous loop: the step boundaries every rank agrees on, and what an
engine host gets back on resume.

Owned here: `Boundaries` (an engine host's thread that meets the other ranks at the boundary
after each version: the collective `CheckpointManager.boundary`, then hands a due save to the
scheduler's `checkpoint` task, which writes it between two works on the main thread) and
`Resumed` (the engine host's saved untrained steps, validation state and `resume/*` counts).
Called by `jobs/grpo_async.py`.

    Megatron ranks   ... param_update(v-1) -> log -> boundary v [save v] -> logp(v) ...
    engine host      boundary thread:  boundary v --(save due)--> checkpoint task (main thread,
                                       waits until the engine holds v, writes, then the next
                                       boundary)
    engine follower  boundary v [save v], for every v, on its main thread

The learner reaches boundary v as soon as version v exists; the engine host's boundary thread
waits for it there without holding the main thread, so generation goes on, and only a save
takes the main thread. A generation in progress when a save is due is cut (`GenerateSide.cut`:
the engine aborts its requests, which come back as prefixes) unless it is of step v, which the
learner trains next and waits for anyway; the generate stage records the step as partial, runs
the save itself once the engine holds v, and then continues the responses from their prefixes.
So the learner waits for the save and for the step it needs, not for a later step's
generation, and no generated token is lost or done twice. A stop (a signal) cuts step v too:
the learner will not train it in this run. A signal anywhere makes every rank save at the
same boundary and stop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_async_rl.checkpoint.pending import STAGES, PendingSteps
from megatron_async_rl.distributed import devices
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.scheduler.states import StageTimeout


class Boundaries(threading.Thread):
    """An engine host's boundaries after versions start+1..steps (see the module doc)."""

    def __init__(self, checkpoints, start: int, steps: int, pending: PendingSteps, saves, wake,
                 device: torch.device | None = None, cut=None):  # fmt: skip
        super().__init__(name="checkpoint-boundaries", daemon=True)
        self.cut = cut
        """Stops the generation in progress (`GenerateSide.cut`) once a save is due: its
        responses are saved as prefixes instead of the save waiting for them."""
        self.device = device
        """This rank's device: the collectives here may be NCCL's (a thread's CUDA device is
        cuda:0 until it is set)."""
        self.checkpoints, self.start_version, self.steps = checkpoints, start, steps
        self.pending, self.saves, self.wake = pending, saves, wake
        self.cond = threading.Condition()
        self.saved_version = start
        self.stop_at: int | None = None
        """The version after which a signal stops the run (saved first)."""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.device is not None:
                devices.bind_thread(self.device)
            for version in range(self.start_version + 1, self.steps + 1):
                save, preempted = self.checkpoints.boundary(version)
                self.pending.drop_before(version)  # version v exists: steps < v are trained
                if preempted:
                    self.stop_at = version
                if save:
                    self.saves.put(version, None)
                    self.wake()
                    if self.cut is not None:  # a stop cuts any generation; a save, a later step's
                        self.cut(None if preempted else version)
                    with self.cond:  # the next boundary's collective after this save's
                        while self.saved_version < version:
                            self.cond.wait()
                if preempted:
                    return
        except BaseException as err:  # noqa: BLE001 - surfaced by `finish`
            self.error = err
        finally:
            self.saves.close()
            self.wake()

    def saved(self, version: int) -> None:
        """Called by the checkpoint task once version `version` is written; raises `Preempted`
        when a signal asked to stop there."""
        with self.cond:
            self.saved_version = version
            self.cond.notify_all()
        if self.stop_at == version:
            raise self.checkpoints.stop_error(version)

    def finish(self, timeout: float, context: dict) -> None:
        self.join(timeout=timeout)
        if self.is_alive():
            raise StageTimeout("the checkpoint boundaries to end", timeout, timeout, context)
        if self.error is not None:
            raise RuntimeError(f"the checkpoint-boundaries thread failed: {self.error}") from (
                self.error
            )


@dataclass
class Resumed:
    """What an engine host resumes with (empty: a fresh start)."""

    saved: dict | None = None
    """The `pending` part of this host's saved state."""
    validated: int = -1
    validations: dict = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    """`resume/*` counts, added to the report of the first step the host sends."""

    def steps(self, start: int) -> dict[str, list[StepWork]]:
        if self.saved is None:
            return {stage: [] for stage in STAGES}
        return PendingSteps.restore(self.saved, start)

    @classmethod
    def from_checkpoint(cls, checkpoints, first_host: bool) -> Resumed:
        """From `checkpoints.restore`'s state of this rank. With another world size the saved
        steps cannot be matched to this host's engine: they are generated again, and the first
        engine host counts every saved token as `resume/tokens_regenerated`."""
        path = checkpoints.chosen[0] if checkpoints is not None else None
        if path is None:
            return cls()
        counts = {}
        state = checkpoints.restored
        if state is not None and "pending" in state.get("gen", {}):
            gen = state["gen"]
            kept = PendingSteps.counts(gen["pending"])
            counts.update({"resume/samples_restored": kept["samples"],
                           "resume/tokens_restored": kept["tokens"],
                           "resume/partial_tokens_restored": kept["partial_tokens"]})  # fmt: skip
            return cls(gen["pending"], gen.get("validated", -1), gen.get("validations", {}),
                       counts)  # fmt: skip
        regenerated = 0.0
        if first_host:
            for file in sorted(Path(path).glob("rank_*.pt")):
                saved = torch.load(file, weights_only=False).get("gen", {})
                if "pending" in saved:
                    kept = PendingSteps.counts(saved["pending"])
                    regenerated += kept["tokens"] + kept["partial_tokens"]
        counts["resume/tokens_regenerated"] = regenerated
        start = int(checkpoints.chosen[1]["step"])
        return cls(None, start - 1, {}, counts)  # versions before `start` count as evaluated
