"""Dynamic sampling with refill (DAPO): which sampled groups a step trains, planned round by round.

Owned here: `RefillPlan` (one step's plan so far, carried by its `StepWork` and saved with it),
`informative_groups` (which of a host's groups got rewards that differ), `RefillPlan.decide`
(one round's decision from every engine host's flags) and the rounds' agreement between engine
hosts (`LocalRounds`, `StoreRounds`). Pure: no torch, no collectives. The generate side
(`roles/generate.py`) applies the decisions to its samples; the loops (`jobs/grpo_sync.py`,
`jobs/grpo_async.py`) decide when a round runs. Read when `algorithm.refill` is true.

    round 0: rollout.num_prompts_per_step prompts drawn -> generated, scored -> flags posted
    every host's flags -> decide: keep the first (target - kept) informative groups, in order
      complete: the batch is the kept groups, renumbered 0..target-1 in draw order; the
                informative groups of the round beyond the target are dropped (counted)
      short:    another round of num_prompts_per_step prompts, drawn right after (same step)
      short after max_refill_rounds: `pad` fills the batch with zero-variance groups (the
                earliest drawn; dynamic filtering masks them out), or `error` stops the run

A group is informative when its samples' rewards (the reward function's, before the learn
side's shaping) are not all equal. A round's decision depends only on the flags of the round's
groups in prompt order, so every engine host reaches the same decision and draws the same next
prompts: their data cursors stay identical, and a step's prompts are contiguous in the data
(the cursor at its first prompt says where all of them are). Engine hosts agree on the flags
through `Rounds`: one host has them all (`LocalRounds`); several post their share to torchrun's
key-value store and read the others' (`StoreRounds`), which needs no collective, so a host
waiting there never holds up a checkpoint's collectives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol


def informative_groups(samples: Iterable, num_samples: int) -> dict[int, bool]:
    """Per prompt index: True when the group's rewards are not all equal. Every group must be
    whole (`num_samples` samples): a missing sample is a protocol error."""
    rewards: dict[int, list[float]] = {}
    for sample in samples:
        rewards.setdefault(sample.prompt_index, []).append(float(sample.reward))
    short = {i: len(r) for i, r in rewards.items() if len(r) != num_samples}
    if short:
        raise RuntimeError(
            f"refill: groups {sorted(short)} have {sorted(set(short.values()))} samples, "
            f"not num_samples_per_prompt = {num_samples}"
        )
    return {i: max(r) > min(r) for i, r in sorted(rewards.items())}


@dataclass
class Decision:
    """What one round's flags mean for the step."""

    done: bool
    """The step's batch is complete (the hosts build it); else another round is drawn."""
    exhausted: bool = False
    """Short after the last round allowed (`pad`: the batch is padded)."""


@dataclass
class RefillPlan:
    """One step's refill so far: counts and prompt indices (within the step's records) only."""

    target: int
    """Informative groups the batch must hold: `rollout.num_prompts_per_step`."""
    max_rounds: int
    """Rounds the step may sample in all: 1 + `algorithm.max_refill_rounds`."""
    pad: bool
    """`algorithm.refill_exhausted: pad` (else error)."""
    rounds: int = 0
    """Rounds decided."""
    round_flags: list[dict[int, bool]] = field(default_factory=list)
    """Every decided round's flags (all hosts'), so a resumed host can post its share again."""
    kept: list[int] = field(default_factory=list)
    """Informative groups kept, in draw order."""
    fillers: list[int] = field(default_factory=list)
    """The earliest zero-variance groups, at most the batch's shortfall (with `pad` only)."""
    padded: int = 0
    dropped_zero_variance: int = 0
    dropped_extra: int = 0
    """Informative groups of the completing round beyond the target."""
    groups_sampled: int = 0
    done: bool = False

    def decide(self, flags: Mapping[int, bool]) -> Decision:
        """Take round `self.rounds`'s flags (every host's): the groups kept, and whether the
        step is complete. Raises when short after the last round with `error`."""
        assert not self.done, "refill: a round decided after the step was complete"
        flags = {int(i): bool(f) for i, f in flags.items()}
        informative = sorted(i for i, f in flags.items() if f)
        zero = sorted(i for i, f in flags.items() if not f)
        keep = informative[: self.target - len(self.kept)]
        self.kept += keep
        self.dropped_extra += len(informative) - len(keep)
        self.dropped_zero_variance += len(zero)
        self.groups_sampled += len(flags)
        self.rounds += 1
        self.round_flags.append(flags)
        if self.pad:  # the earliest zero-variance groups, as many as the batch may lack
            self.fillers = (self.fillers + zero)[: self.target - len(self.kept)]
        short = self.target - len(self.kept)
        exhausted = short > 0 and self.rounds >= self.max_rounds
        if exhausted and not self.pad:
            raise RuntimeError(
                f"refill: {len(self.kept)} informative groups of {self.target} after "
                f"{self.rounds} rounds (algorithm.max_refill_rounds = {self.max_rounds - 1}, "
                f"{self.groups_sampled} groups sampled): raise algorithm.max_refill_rounds, "
                "set algorithm.refill_exhausted: pad, or check the reward (does it vary with "
                "the response?) and the data (too easy or too hard for the model?)"
            )
        if exhausted:
            self.padded = short
            self.dropped_zero_variance -= short
        self.done = short == 0 or exhausted
        return Decision(self.done, exhausted)

    def holding(self) -> set[int]:
        """The groups whose samples a host keeps for now: kept, and fillers."""
        return set(self.kept) | set(self.fillers)

    def batch_order(self) -> list[int]:
        """The trained groups' prompt indices in draw order (position = new prompt index)."""
        assert self.done, "refill: the batch asked for before the step was complete"
        return sorted(self.kept + self.fillers[: self.padded])

    def metrics(self) -> dict[str, float]:
        """The step's `dynamic_sampling/*` numbers, the same on every engine host (means)."""
        return {
            "dynamic_sampling/groups_sampled": float(self.groups_sampled),
            "dynamic_sampling/groups_kept": float(len(self.kept)),
            "dynamic_sampling/groups_dropped_zero_variance": float(self.dropped_zero_variance),
            "dynamic_sampling/groups_dropped_extra": float(self.dropped_extra),
            "dynamic_sampling/groups_padded": float(self.padded),
            "dynamic_sampling/rounds": float(self.rounds),
            # generation beyond one batch's groups, as a fraction of one batch
            "dynamic_sampling/extra_generation_frac": (
                (self.groups_sampled - self.target) / self.target
            ),
        }

    def state_dict(self) -> dict:
        state = asdict(self)
        state["round_flags"] = [sorted(flags.items()) for flags in self.round_flags]
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping) -> RefillPlan:
        state = dict(state)
        state["round_flags"] = [{int(i): bool(f) for i, f in r} for r in state["round_flags"]]
        return cls(**state)


class Rounds(Protocol):
    """How the engine hosts agree on a round's flags."""

    def post(self, step: int, round_index: int, flags: Mapping[int, bool]) -> None:
        """This host's flags of (step, round); posting the same again is harmless."""

    def gather(self, step: int, round_index: int) -> dict[int, bool] | None:
        """Every host's flags of (step, round) merged, or None while some are missing."""

    def missing(self, step: int, round_index: int) -> list[int]:
        """The engine hosts (by index) whose flags of (step, round) have not come."""


class LocalRounds:
    """One engine host: its flags are all the flags."""

    def __init__(self):
        self._flags: dict[tuple[int, int], dict[int, bool]] = {}

    def post(self, step, round_index, flags):
        self._flags = {k: v for k, v in self._flags.items() if k[0] >= step - 1}
        self._flags[step, round_index] = dict(flags)

    def gather(self, step, round_index):
        return self._flags.get((step, round_index))

    def missing(self, step, round_index):
        return [] if (step, round_index) in self._flags else [0]


class StoreRounds:
    """Several engine hosts: each posts its flags under `<step>/<round>/<host>` in a key-value
    store every host reaches (torchrun's: `torch.distributed.PrefixStore` over the world's
    store; any object with set, get, check and delete_key) and reads the others'.

    A host deletes its own keys of step s - 2 when it first posts for step s: by then every host
    has read them (a host posts for step s only after it decided step s - 1, which needed every
    host's flags of s - 1, which each posted after deciding s - 2)."""

    POLL_S = 0.01
    """At most one look at the store per this many seconds (the scheduler polls guards often)."""

    def __init__(self, store, index: int, num_hosts: int):
        self.store, self.index, self.num_hosts = store, index, num_hosts
        self._posted: dict[int, set[str]] = {}
        self._merged: dict[tuple[int, int], dict[int, bool]] = {}
        self._last_look = 0.0

    @staticmethod
    def key(step: int, round_index: int, host: int) -> str:
        return f"{step}/{round_index}/{host}"

    def post(self, step, round_index, flags):
        key = self.key(step, round_index, self.index)
        if key in self._posted.get(step, ()):
            return
        self.store.set(key, json.dumps(sorted(flags.items())))
        self._posted.setdefault(step, set()).add(key)
        for old in [s for s in self._posted if s <= step - 2]:
            for stale in self._posted.pop(old):
                self.store.delete_key(stale)
        self._merged = {k: v for k, v in self._merged.items() if k[0] >= step - 1}

    def gather(self, step, round_index):
        merged = self._merged.get((step, round_index))
        if merged is not None:
            return merged
        now = time.monotonic()
        if now - self._last_look < self.POLL_S:
            return None
        self._last_look = now
        keys = [self.key(step, round_index, h) for h in range(self.num_hosts)]
        if not self.store.check(keys):
            return None
        merged = {}
        for host, key in enumerate(keys):
            for index, flag in json.loads(self.store.get(key)):
                if index in merged:
                    raise RuntimeError(
                        f"refill: engine host {host} posted prompt {index} of step {step}, round "
                        f"{round_index}, which another host posted too (hosts serve disjoint "
                        "shares)"
                    )
                merged[int(index)] = bool(flag)
        self._merged[step, round_index] = merged
        return merged

    def missing(self, step, round_index):
        return [h for h in range(self.num_hosts)
                if not self.store.check([self.key(step, round_index, h)])]  # fmt: skip


def wait_for_round(rounds: Rounds, step: int, round_index: int, timeout_s: float,
                   who: str) -> dict[int, bool]:  # fmt: skip
    """Every host's flags of (step, round), waiting at most `timeout_s` (the synchronous loop,
    where every engine host samples the same round at the same time)."""
    deadline = time.monotonic() + timeout_s
    while (flags := rounds.gather(step, round_index)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{who}, step {step}: no refill flags of round {round_index} from engine hosts "
                f"{rounds.missing(step, round_index)} within {timeout_s:g} s "
                "(scheduler.stage_timeout_s)"
            )
        time.sleep(0.005)
    return flags
