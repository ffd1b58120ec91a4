"""Role names and the rank-window spec of a recipe's `roles.groups`: pure, no torch.

Owned here because both the recipe schema and the pure `distributed.layout` need them, and the
layout must import neither torch nor megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import require_int, require_number
from megatron_async_rl.config.errors import ConfigError

ROLES = ("train", "logp", "ref", "generate", "critic", "reward_model")
MEGATRON_ROLES = ("train", "logp", "ref", "critic", "reward_model")
REQUIRED_MEGATRON_ROLES = ("train",)
"""Placed in every recipe. The others only where the run uses them: `logp` for the old
log-probs' own pass, `ref` for a KL term (`algorithms.passes`), `critic` (PPO's value model),
`reward_model` (a scalar-head scorer)."""
TRAINED_ROLES = ("train", "critic")
"""Megatron roles with an optimizer (the others are forward-only)."""


@dataclass
class RoleGroupSpec:
    """One rank window of the world; the roles listed time-share its ranks."""

    roles: list[str]
    """Roles placed on this window, e.g. [logp, train]."""
    num_ranks: int | None = None
    """Ranks in the window. Exactly one of num_ranks and ratio is set."""
    ratio: float | None = None
    """Fraction of the world (or, next to num_ranks groups, of the ranks they leave)."""

    def __post_init__(self) -> None:
        if isinstance(self.roles, tuple):
            self.roles = list(self.roles)
        if not isinstance(self.roles, list) or not self.roles:
            raise ConfigError("roles", self.roles, "must be a non-empty list of role names")
        for index, role in enumerate(self.roles):
            if role not in ROLES:
                raise ConfigError(
                    f"roles[{index}]", role, f"unknown role; roles are {', '.join(ROLES)}"
                )
        duplicates = sorted({r for r in self.roles if self.roles.count(r) > 1})
        if duplicates:
            raise ConfigError("roles", self.roles, f"lists {', '.join(duplicates)} twice")
        if (self.num_ranks is None) == (self.ratio is None):
            raise ConfigError(
                "num_ranks",
                self.num_ranks,
                "set exactly one of num_ranks and ratio",
                f"ratio = {self.ratio}",
            )
        if self.num_ranks is not None:
            require_int("num_ranks", self.num_ranks, 1)
        if self.ratio is not None:
            self.ratio = require_number("ratio", self.ratio, gt=0, le=1)
