"""The recipe's `critic:` section: PPO-with-a-critic knobs, validated; pure (no torch).

Owned here so the config package imports without torch; the math that reads these knobs
(`token_rewards`, `gae`, `whiten`, `value_loss`) lives in `algorithms.ppo`. Error keys are
relative (`gamma`); the recipe loader prefixes them (`critic.gamma`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.algorithms.config import LOSS_AGG_MODES
from megatron_async_rl.config.checks import (
    require_bool,
    require_choice,
    require_int,
    require_number,
)
from megatron_async_rl.config.errors import ConfigError

POLICY_INIT = "policy"
"""`init: policy`: the value model starts from the policy's weights (the usual choice)."""


@dataclass
class CriticConfig:
    """The `critic:` section: the value model's start, its loss and the GAE parameters."""

    gamma: float = 1.0
    """GAE discount per model token (Schulman et al. 2016); 1.0, the usual choice for LLMs,
    does not discount a terminal reward over a long response."""
    lam: float = 0.95
    """GAE lambda: 0 gives the one-step TD advantage r + gamma V' - V, 1 the Monte Carlo return
    minus V."""
    value_clip: float | None = 0.2
    """PPO2 value clipping: the new value is clipped to old value +- value_clip and the larger
    of the two squared errors is taken (`ppo.value_loss`). null: unclipped."""
    loss_agg_mode: str = "token-mean"
    """How the per-token value loss is reduced: token-mean, seq-mean-token-mean,
    seq-mean-token-sum or seq-mean-token-sum-norm (`losses.aggregate`)."""
    warmup_steps: int = 0
    """Critic-only RL steps before the actor trains, so a fresh value head is not trusted on the
    first advantages. 0: the actor trains from the first step."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages over the batch's trained tokens (`ppo.whiten`), as OpenRLHF
    and verl do for PPO."""
    init: str = POLICY_INIT
    """Where the value model starts from: `policy` (the policy's weights, a new value head) or a
    Hugging Face model directory (e.g. a reward model)."""
    value_head_init_std: float = 0.0
    """Std of the normal init of the value head's weights; 0.0: zero init (every value starts
    at 0, so the first advantages are the rewards-to-go)."""

    def __post_init__(self) -> None:
        gae_range = "GAE needs a discount and a lambda in [0, 1]"
        self.gamma = require_number("gamma", self.gamma, ge=0, le=1, hint=gae_range)
        self.lam = require_number("lam", self.lam, ge=0, le=1, hint=gae_range)
        self.value_clip = require_number(
            "value_clip",
            self.value_clip,
            gt=0,
            optional=True,
            hint="null turns value clipping off; 0.2 is usual",
        )
        require_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        require_int("warmup_steps", self.warmup_steps, 0, hint="0: the actor trains at once")
        require_bool("whiten_advantages", self.whiten_advantages)
        if not isinstance(self.init, str) or not self.init.strip():
            raise ConfigError(
                "init", self.init,
                f"must be {POLICY_INIT} or a Hugging Face model directory (a non-empty string)",
                f"{POLICY_INIT} starts the value model from the policy's weights",
            )  # fmt: skip
        self.value_head_init_std = require_number(
            "value_head_init_std",
            self.value_head_init_std,
            ge=0,
            hint="0.0 initialises the value head to zero",
        )
