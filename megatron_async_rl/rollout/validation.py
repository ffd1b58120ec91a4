"""Validation: score a held-out prompt set with the weights of one named policy version.

Owned here: `Validator`, which runs one evaluation on a generate rank's engine and returns its
`val/` metrics; the recipe's `validation:` section is `rollout.config.ValidationConfig`. When a
version is due (`scheduler.validation_every`) and which weights it uses
(`scheduler.validation_version`) is the jobs' decision (`jobs/grpo_sync.py`,
`jobs/grpo_async.py`); they move the `validation` stage machine around each call. Validation
never touches the training data cursor, the training reward's counters or the training samples'
seeds, so turning it on leaves the training numbers unchanged (tested).

    validation:
      data: {path: runs/arith/val.jsonl, shuffle: false}
      num_prompts: 64          # the first 64 rows (null: all), the same rows every time
      temperature: 0.0         # greedy: one response per prompt is enough
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_async_rl.rollout.config import RolloutConfig, ValidationConfig
from megatron_async_rl.rollout.generation import served_prompts

# Requests of validation passes carry steps far from any training step, so their seeds never
# coincide with a training request's (seeds hash run seed, step, uid and sample index).
SEED_STEP_OFFSET = 1 << 30


@dataclass
class Validator:
    """One generate rank's validation passes: its share of the held-out prompts, scored."""

    config: ValidationConfig
    rollout: RolloutConfig
    records: list
    """The held-out rows this run evaluates (the first `num_prompts` of the file)."""
    reward: object
    """A `SafeReward` of its own: validation never adds to the training reward's counters."""
    rank_in_role: int
    num_generate_ranks: int
    run_seed: int
    passes: int = field(default=0, init=False)

    def run(self, engine, tokenizer, version: int, encode) -> dict[str, float]:
        """Evaluate this rank's share with the engine's current weights (version `version`).

        `encode(record)` gives a record's prompt token ids. Returns `val/` metrics; counts are
        per rank (`val/num_samples`), means are over this rank's samples.
        """
        from megatron_async_rl.rollout.generation import generate_samples

        mine = served_prompts(len(self.records), self.rank_in_role, self.num_generate_ranks)
        ids = {i: self.records[i].prompt_ids or encode(self.records[i]) for i in mine}
        samples = generate_samples(
            engine, tokenizer, self.records, ids, mine, self.config.num_samples_per_prompt,
            self.config.rollout_config(self.rollout), step=SEED_STEP_OFFSET + version,
            run_seed=self.run_seed,
        )  # fmt: skip
        rewards = self.reward.score(samples)
        self.passes += 1
        count = max(len(samples), 1)
        return {
            "val/version": float(version),
            "val/reward_mean": sum(rewards) / count,
            "val/accuracy": sum(r >= 1.0 for r in rewards) / count,
            "val/response_len_mean": sum(len(s.response_ids) for s in samples) / count,
            "val/num_samples": float(len(samples)),
            "val/reward_errors": float(self.reward.errors),
        }
