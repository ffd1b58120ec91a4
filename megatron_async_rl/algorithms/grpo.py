"""GRPO-family knobs and the per-batch math that runs before the train step.

Owned here: `GRPOConfig` (the recipe's `algorithm:` section), group-normalised advantages,
DAPO dynamic filtering of zero-variance groups, the per-token KL estimators to the reference
policy and the KL-in-reward penalty. The advantage stage calls, once per batch and in this order,
`kl_reward` (only when `kl_mode == "reward"`), `dynamic_filter` (when `dynamic_filtering`) and
`group_advantages`. The losses the train role minimises per micro-batch are in
`algorithms.losses`, which also uses `kl_penalty`. Pure torch: no collectives, no Megatron.

Shape suffixes: B samples (responses; a prompt's `num_samples_per_prompt` samples form one group),
T response positions (right-padded; a 0/1 or bool mask marks the real ones), G groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_async_rl.config.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
KL_MODES = ("loss", "reward")
OFF_POLICY_CORRECTIONS = ("none", "tis_token", "tis_seq", "decoupled")

K3_LOG_RATIO_BOUND = 20.0
"""k3 clamps log(ref / p) to +-20 before exp so the exponential stays finite in fp32."""
K3_VALUE_BOUND = 10.0
"""k3 clamps its value to [-10, 10] (in effect [0, 10], as k3 >= 0), like verl's low_var_kl."""


def _require_float(
    key: str, value: Any, ok: Callable[[float], bool], rule: str, hint: str | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, value, "expected a finite number")
    if not ok(float(value)):
        raise ConfigError(key, value, rule, hint)


def _require_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, value, f"must be one of {', '.join(choices)}")


def _require_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "expected true or false")


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

    def __post_init__(self) -> None:
        n = self.num_samples_per_prompt
        if isinstance(n, bool) or not isinstance(n, int):
            raise ConfigError("num_samples_per_prompt", n, "expected an integer")
        if n < 1:
            raise ConfigError("num_samples_per_prompt", n, "must be >= 1")
        _require_bool("normalize_advantage_by_std", self.normalize_advantage_by_std)
        _require_float("advantage_eps", self.advantage_eps, lambda v: v > 0, "must be > 0")
        _require_float(
            "clip_ratio_low",
            self.clip_ratio_low,
            lambda v: 0 <= v < 1,
            "must be in [0, 1)",
            "the ratio is clipped below at 1 - clip_ratio_low, which must stay positive",
        )
        _require_float("clip_ratio_high", self.clip_ratio_high, lambda v: v >= 0, "must be >= 0")
        if self.clip_ratio_c is not None:
            _require_float(
                "clip_ratio_c",
                self.clip_ratio_c,
                lambda v: v > 1,
                "must be > 1 or null",
                "dual-clip bounds a negative-advantage loss at c * |A|; 3.0 is usual",
            )
        _require_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _require_float("kl_coef", self.kl_coef, lambda v: v >= 0, "must be >= 0")
        _require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.kl_estimator == "low_var_kl":
            self.kl_estimator = "k3"
        _require_choice("kl_mode", self.kl_mode, KL_MODES)
        _require_float("entropy_coef", self.entropy_coef, lambda v: v >= 0, "must be >= 0")
        _require_bool("dynamic_filtering", self.dynamic_filtering)
        if self.dynamic_filtering and n == 1:
            raise ConfigError(
                "dynamic_filtering",
                True,
                "needs num_samples_per_prompt >= 2",
                "a group of one sample has zero variance, so every group would be dropped",
            )
        _require_choice("off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        _require_float(
            "tis_cap",
            self.tis_cap,
            lambda v: v >= 1,
            "must be >= 1",
            "a cap below 1 would shrink even on-policy tokens (weight 1)",
        )


def _group_index(groups: int | torch.Tensor, rewards_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each sample's group number in [0, G), and G."""
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D, got shape {tuple(rewards_B.shape)}")
    num_samples = rewards_B.shape[0]
    if isinstance(groups, torch.Tensor):
        if groups.shape != (num_samples,):
            raise ValueError(
                f"group_ids_B has shape {tuple(groups.shape)}; expected ({num_samples},)"
            )
        labels_G, index_B = torch.unique(groups, return_inverse=True)
        return index_B.to(rewards_B.device), labels_G.numel()
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"group size must be an int >= 1 or a group_ids_B tensor, got {groups!r}")
    if num_samples % groups:
        raise ValueError(
            f"{num_samples} samples do not split into groups of {groups} consecutive samples; "
            "pass group_ids_B instead"
        )
    return torch.arange(num_samples, device=rewards_B.device) // groups, num_samples // groups


def _float(rewards_B: torch.Tensor) -> torch.Tensor:
    return rewards_B if rewards_B.is_floating_point() else rewards_B.float()


def group_advantages(
    rewards_B: torch.Tensor,
    groups: int | torch.Tensor,
    *,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std.

    `groups` is either the group size (groups are runs of consecutive samples) or `group_ids_B`
    (any labels; samples with equal labels form a group). std_g is the unbiased sample std,
    sqrt(sum_i (r_i - mean_g)^2 / (n_g - 1)), as `torch.std` and verl compute it. A group of one
    sample gets advantage 0 (r - mean is exactly 0; its variance is taken as 0), also when
    eps = 0.
    """
    rewards_B = _float(rewards_B)
    index_B, num_groups = _group_index(groups, rewards_B)
    zeros_G = rewards_B.new_zeros(num_groups)
    count_G = zeros_G.index_add(0, index_B, torch.ones_like(rewards_B))
    mean_G = zeros_G.index_add(0, index_B, rewards_B) / count_G
    adv_B = rewards_B - mean_G[index_B]
    if normalize_by_std:
        var_G = zeros_G.index_add(0, index_B, adv_B.square()) / (count_G - 1).clamp(min=1)
        denom_B = var_G.sqrt()[index_B] + eps
        # Only a zero-variance group with eps = 0 has denom 0; its r - mean is 0 too.
        adv_B = torch.where(denom_B > 0, adv_B / denom_B, torch.zeros_like(adv_B))
    return adv_B


def dynamic_filter(rewards_B: torch.Tensor, groups: int | torch.Tensor) -> tuple[torch.Tensor, int]:
    """DAPO dynamic sampling: keep only groups whose rewards are not all equal.

    Returns (keep_B, num_dropped_groups); keep_B is bool. Zero variance is tested exactly
    (max == min), so a group of one sample is always dropped. A dropped group's advantages are 0
    anyway; dropping it (or zeroing its rows of mask_BT) takes its tokens out of the loss
    denominators and out of the KL and entropy terms.
    """
    rewards_B = _float(rewards_B)
    index_B, num_groups = _group_index(groups, rewards_B)
    empty_G = rewards_B.new_zeros(num_groups)
    max_G = empty_G.scatter_reduce(0, index_B, rewards_B, "amax", include_self=False)
    min_G = empty_G.scatter_reduce(0, index_B, rewards_B, "amin", include_self=False)
    keep_G = max_G > min_G
    return keep_G[index_B], int((~keep_G).sum())


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with d = logp - ref_logp:

    k1 = d; k2 = d^2 / 2; k3 ("low_var_kl") = exp(-d) + d - 1, which is >= 0 and unbiased.
    k3 clamps -d to [-20, 20] before exp and the result to [-10, 10] (verl's bounds): a clamped
    token has zero gradient. Padded positions are not masked here; `aggregate` masks them.
    """
    log_ratio_BT = logp_BT - ref_logp_BT
    if estimator == "k1":
        return log_ratio_BT
    if estimator == "k2":
        return 0.5 * log_ratio_BT.square()
    if estimator in ("k3", "low_var_kl"):
        ref_log_ratio_BT = (-log_ratio_BT).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        kl_BT = ref_log_ratio_BT.exp() - ref_log_ratio_BT - 1
        return kl_BT.clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def kl_reward(
    rewards_B: torch.Tensor, kl_BT: torch.Tensor, mask_BT: torch.Tensor, coef: float
) -> torch.Tensor:
    """kl_mode == "reward": r_i - coef * sum_t kl_it over real tokens, before advantages.

    `kl_BT` is detached: a reward is data, never differentiated.
    """
    masked_BT = torch.where(mask_BT.bool(), kl_BT.detach(), torch.zeros_like(kl_BT))
    return _float(rewards_B) - coef * masked_BT.sum(dim=-1)
