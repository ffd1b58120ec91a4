"""What the run writes for people to read (recipe section `observability:`).

    observability: {dump_rollouts_every: 10, show_sample_every: 10}

Error keys are relative (`dump_rollouts_every`); the recipe loader prefixes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from megatron_async_rl.config.checks import require_choice, require_int
from megatron_async_rl.config.errors import ConfigError, suggest

WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    project: str = ""
    """The W&B project (required)."""
    mode: str = "online"
    """`online`, `offline` (written under `<run_dir>/wandb/`, `wandb sync` later) or `disabled`."""
    entity: str | None = None
    """The W&B team or user the run is logged under [W&B's default entity of the logged-in user]."""
    name: str | None = None
    """The W&B run's display name [the run directory's name]."""
    tags: list[str] = field(default_factory=list)
    """Tags attached to the W&B run (a list of strings)."""

    def __post_init__(self) -> None:
        if not isinstance(self.project, str) or not self.project.strip():
            raise ConfigError("wandb.project", self.project, "must name a W&B project")
        require_choice("wandb.mode", self.mode, WANDB_MODES)
        if not isinstance(self.tags, list) or not all(isinstance(t, str) for t in self.tags):
            raise ConfigError("wandb.tags", self.tags, "must be a list of strings")


@dataclass
class ObservabilityConfig:
    dump_rollouts_every: int = 10
    """Every this many steps the leader writes the step's samples to
    `<run_dir>/rollouts/step_<N>.jsonl` (prompt, response, answer, reward, advantage, finish
    reason, the weight versions of its tokens); 0: never."""

    show_sample_every: int = 10
    """Every this many steps the leader's progress shows one of the step's samples (prompt,
    response, answer, reward) on one line; 0: never."""

    wandb: WandbConfig | dict | None = None
    """Mirror the metrics to Weights & Biases: `{project, mode: online|offline|disabled,
    entity, name, tags}` (`observability/wandb_sink.py`); None: no W&B."""

    def __post_init__(self) -> None:
        require_int("dump_rollouts_every", self.dump_rollouts_every, 0)
        require_int("show_sample_every", self.show_sample_every, 0)
        if isinstance(self.wandb, dict):
            known = [f.name for f in fields(WandbConfig)]
            for key in self.wandb:
                if key not in known:
                    hint = suggest(key, known)
                    raise ConfigError(f"wandb.{key}", self.wandb[key], "unknown key",
                                      hint or f"known: {', '.join(known)}")  # fmt: skip
            self.wandb = WandbConfig(**self.wandb)
        elif self.wandb is not None and not isinstance(self.wandb, WandbConfig):
            raise ConfigError("wandb", self.wandb, "must be a mapping {project, mode, ...}")
