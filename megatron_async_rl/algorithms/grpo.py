"""GRPO-family per-batch math that runs before the train step.

Owned here: group-normalised advantages, DAPO dynamic filtering of zero-variance groups, the
per-token KL estimators to the reference policy and the KL-in-reward penalty. Their knobs, the
recipe's `algorithm:` section, are `algorithms.config.GRPOConfig` (re-exported here). The
advantage stage calls, once per batch and in this order, `kl_reward` (only when
`kl_mode == "reward"`), `dynamic_filter` (when `dynamic_filtering`) and
`advantages.compute_advantages` (`group_advantages` for grpo and dr_grpo). The losses the
train role minimises per micro-batch are in `algorithms.losses`, which also uses `kl_penalty`.
Pure torch: no collectives, no Megatron.

Shape suffixes: B samples (responses; a prompt's `num_samples_per_prompt` samples form one group),
T response positions (right-padded; a 0/1 or bool mask marks the real ones), G groups.
"""

from __future__ import annotations

import torch

from megatron_async_rl.algorithms.config import (  # noqa: F401 - re-exported
    K3_LOG_RATIO_BOUND,
    K3_VALUE_BOUND,
    KL_ESTIMATORS,
    KL_MODES,
    LOSS_AGG_MODES,
    OFF_POLICY_CORRECTIONS,
    GRPOConfig,
)


def group_index(groups: int | torch.Tensor, rewards_B: torch.Tensor) -> tuple[torch.Tensor, int]:
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
    index_B, num_groups = group_index(groups, rewards_B)
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
    index_B, num_groups = group_index(groups, rewards_B)
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
