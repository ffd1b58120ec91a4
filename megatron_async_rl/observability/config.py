"""What the run writes for people to read (recipe section `observability:`).

    observability: {dump_rollouts_every: 10, show_sample_every: 10}

Error keys are relative (`dump_rollouts_every`); the recipe loader prefixes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import require_int


@dataclass
class ObservabilityConfig:
    dump_rollouts_every: int = 10
    """Every this many steps the leader writes the step's samples to
    `<run_dir>/rollouts/step_<N>.jsonl` (prompt, response, answer, reward, advantage, finish
    reason, the weight versions of its tokens); 0: never."""

    show_sample_every: int = 10
    """Every this many steps the leader's progress shows one of the step's samples (prompt,
    response, answer, reward) on one line; 0: never."""

    def __post_init__(self) -> None:
        require_int("dump_rollouts_every", self.dump_rollouts_every, 0)
        require_int("show_sample_every", self.show_sample_every, 0)
