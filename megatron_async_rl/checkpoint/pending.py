"""An engine host's steps between its dataloader and the learner's optimizer step, kept for a
checkpoint of the asynchronous loop, so that a resume loses no prompt and no generated token.

Owned here: `PendingSteps`. Called by `jobs/grpo_async.py`: every step the engine host loads,
generates and scores is recorded here by the stage that just finished it (on the main thread,
where those stages run), a step stays until the learner has trained it (`drop_before(v)` once
version v exists), and a save writes every step still here with the stage it reached
(`state_dict`): prompts loaded, responses cut short (a generation stopped for the save: each
response's prefix, its engine log-probs and per-token versions), samples generated, samples
scored (sent to the learner or not). A resumed engine host puts each step back where it was
(`restore`): scored steps are sent again (the learner drops what it had received), generated
ones are scored, partial ones continued from their prefixes, loaded ones generated; the data
cursor continues after the last loaded step.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from megatron_async_rl.roles.work import StepWork

LOADED, PARTIAL, GENERATED, SCORED = "loaded", "partial", "generated", "scored"
STAGES = (LOADED, PARTIAL, GENERATED, SCORED)


class PendingSteps:
    """Steps not yet trained, by step, with the stage each reached (thread-safe)."""

    def __init__(self):
        self._steps: dict[int, tuple[str, StepWork]] = {}
        self.lock = threading.Lock()
        """Held while a snapshot is written, and by whoever changes a recorded step's report
        (the samples sender)."""

    def record(self, work: StepWork, stage: str) -> StepWork:
        if stage not in STAGES:
            raise ValueError(f"PendingSteps.record: stage {stage!r} is not one of {STAGES}")
        with self.lock:
            self._steps[work.step] = (stage, work)
        return work

    def drop_before(self, version: int) -> None:
        """Forget the steps < `version`: version `version` exists, so they are trained."""
        with self.lock:
            for step in [s for s in self._steps if s < version]:
                del self._steps[step]

    def first_cursor(self) -> dict | None:
        """The data cursor at the first prompt of the oldest step kept (None: none kept)."""
        with self.lock:
            if not self._steps:
                return None
            return self._steps[min(self._steps)][1].cursor

    def state_dict(self) -> dict:
        with self.lock:
            return {
                "steps": [
                    {"stage": stage, "work": work.state_dict()}
                    for _, (stage, work) in sorted(self._steps.items())
                ]
            }

    @staticmethod
    def restore(state: Mapping, first_step: int) -> dict[str, list[StepWork]]:
        """The saved steps >= `first_step` by the stage they reached, each list in step order;
        refuses a gap (the stages run in step order, so the saved steps are consecutive)."""
        out: dict[str, list[StepWork]] = {stage: [] for stage in STAGES}
        steps = []
        for entry in state["steps"]:
            work = StepWork.from_state_dict(entry["work"])
            if work.step >= first_step:
                out[entry["stage"]].append(work)
                steps.append(work.step)
        if steps != list(range(first_step, first_step + len(steps))):
            raise RuntimeError(
                f"checkpoint: the engine host's saved steps {steps} are not consecutive from "
                f"step {first_step}: the checkpoint is inconsistent"
            )
        return out

    @staticmethod
    def counts(state: Mapping) -> dict[str, float]:
        """Samples and response tokens kept in a saved state: whole ones (generated or scored
        steps) and the prefixes of partial steps."""
        samples = tokens = partial = 0
        for entry in state["steps"]:
            for sample in entry["work"]["samples"] or []:
                if entry["stage"] == PARTIAL:
                    partial += len(sample["response_ids"])
                    continue
                samples += 1
                tokens += len(sample["response_ids"])
        return {"samples": float(samples), "tokens": float(tokens),
                "partial_tokens": float(partial)}  # fmt: skip
