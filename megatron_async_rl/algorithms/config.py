"""The recipe's `algorithm:` section: GRPO-family knobs, validated; pure (no torch).

Owned here so the config package imports without torch; the math lives in `algorithms.grpo`
and `algorithms.losses`, which read this config.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import (
    require_bool,
    require_choice,
    require_int,
    require_number,
)
from megatron_async_rl.config.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
KL_MODES = ("loss", "reward")
OFF_POLICY_CORRECTIONS = ("none", "tis_token", "tis_seq", "decoupled")

K3_LOG_RATIO_BOUND = 20.0
"""k3 clamps log(ref / p) to +-20 before exp so the exponential stays finite in fp32."""
K3_VALUE_BOUND = 10.0
"""k3 clamps its value to [-10, 10] (in effect [0, 10], as k3 >= 0), like verl's low_var_kl."""


@dataclass
class GRPOConfig:
    """The `algorithm:` section. Error keys are relative (`clip_ratio_low`); the recipe loader
    prefixes them (`algorithm.clip_ratio_low`)."""

    num_samples_per_prompt: int = 8
    """Samples generated per prompt; they form one advantage group."""
    normalize_advantage_by_std: bool = True
    """GRPO: divide by the group's (unbiased) std. False: Dr. GRPO-style r - mean only."""
    advantage_eps: float = 1e-6
    """Added to the group std before dividing."""
    clip_ratio_low: float = 0.2
    """The ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """The ratio is clipped above at 1 + clip_ratio_high (DAPO clip-higher: e.g. 0.28)."""
    clip_ratio_c: float | None = None
    """Dual-clip: a negative-advantage token's loss is at most c * |A|. None: off; 3.0 is usual."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-mean or seq-mean-token-sum (see `losses.aggregate`)."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy; 0 disables it (and the ref role is not needed)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (alias low_var_kl, stored as k3); see `kl_penalty`."""
    kl_mode: str = "loss"
    """loss: kl_coef * KL is added to the loss; reward: subtracted from the sequence reward."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the loss subtracts entropy_coef * entropy)."""
    dynamic_filtering: bool = False
    """DAPO: drop groups whose rewards all agree (zero variance, zero advantage)."""
    off_policy_correction: str = "none"
    """none, tis_token, tis_seq or decoupled (see `losses.policy_loss`)."""
    tis_cap: float = 2.0
    """Cap on the behaviour importance weight exp(old_logp - behaviour_logp)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per RL step, each in mini-batches of Megatron's
    --global-batch-size samples (one optimizer step each; see `algorithms.minibatch`)."""
    shuffle_minibatches: bool = True
    """Shuffle the samples into mini-batches each epoch (seeded by the run's seed, the RL step and
    the epoch, so every data-parallel rank and every rerun splits alike); false: in order."""

    def __post_init__(self) -> None:
        n = require_int("num_samples_per_prompt", self.num_samples_per_prompt, 1)
        require_bool("normalize_advantage_by_std", self.normalize_advantage_by_std)
        require_number("advantage_eps", self.advantage_eps, gt=0)
        require_number(
            "clip_ratio_low",
            self.clip_ratio_low,
            ge=0,
            lt=1,
            hint="the ratio is clipped below at 1 - clip_ratio_low, which must stay positive",
        )
        require_number("clip_ratio_high", self.clip_ratio_high, ge=0)
        require_number(
            "clip_ratio_c",
            self.clip_ratio_c,
            gt=1,
            optional=True,
            hint="dual-clip bounds a negative-advantage loss at c * |A|; 3.0 is usual",
        )
        require_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        require_number("kl_coef", self.kl_coef, ge=0)
        require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.kl_estimator == "low_var_kl":
            self.kl_estimator = "k3"
        require_choice("kl_mode", self.kl_mode, KL_MODES)
        require_number("entropy_coef", self.entropy_coef, ge=0)
        require_bool("dynamic_filtering", self.dynamic_filtering)
        if self.dynamic_filtering and n == 1:
            raise ConfigError(
                "dynamic_filtering",
                True,
                "needs num_samples_per_prompt >= 2",
                "a group of one sample has zero variance, so every group would be dropped",
            )
        require_choice("off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        require_number(
            "tis_cap",
            self.tis_cap,
            ge=1,
            hint="a cap below 1 would shrink even on-policy tokens (weight 1)",
        )
        require_int("ppo_epochs", self.ppo_epochs, 1)
        require_bool("shuffle_minibatches", self.shuffle_minibatches)
