"""Reward shaping and advantage estimators: a batch's rewards to one advantage per sample.

Owned here: DAPO's soft overlong punishment (`overlong_penalty`), the leave-one-out baseline
(`rloo_advantages`), token-weighted batch whitening (`whiten`) and `compute_advantages`, which
applies the estimator `algorithm.advantage_estimator` names. `roles/learn.py:LearnSide.train`
calls them once per batch, before the mini-batches are cut, so every estimator is exact under
PPO mini-batches and micro-batching (an advantage is data to the loss). Group math is
`algorithms.grpo`'s. Pure torch: no collectives.

Shape suffixes: B samples (a prompt's samples form one group), T response positions.
"""

from __future__ import annotations

import torch

from megatron_async_rl.algorithms.config import ADVANTAGE_ESTIMATORS, GRPOConfig
from megatron_async_rl.algorithms.grpo import group_advantages, group_index


def overlong_penalty(
    response_len_B: torch.Tensor, max_len: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each sample's reward:
    with L_max = max_len, L_buf = buffer_len and |y| the response length,

      0                                          |y| <= L_max - L_buf
      -factor * (|y| - (L_max - L_buf)) / L_buf  L_max - L_buf < |y| <= L_max
      -factor                                    |y| > L_max
    buffer_len 0 turns it off (all zeros)."""
    lengths_B = response_len_B.float()
    if buffer_len == 0:
        return torch.zeros_like(lengths_B)
    excess_B = (lengths_B - (max_len - buffer_len)).clamp(min=0) / buffer_len
    return -factor * excess_B.clamp(max=1)


def rloo_advantages(rewards_B: torch.Tensor, groups: int | torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean of the other n_g - 1
    rewards of i's group = n_g / (n_g - 1) * (r_i - mean_g). A group of one gets 0."""
    index_B, num_groups = group_index(groups, rewards_B)
    count_G = torch.zeros(num_groups, device=rewards_B.device).index_add(
        0, index_B, torch.ones_like(index_B, dtype=torch.float32)
    )
    n_B = count_G[index_B]
    centred_B = group_advantages(rewards_B, groups, normalize_by_std=False)
    return torch.where(n_B > 1, centred_B * n_B / (n_B - 1).clamp(min=1), torch.zeros_like(n_B))


def whiten(values_B: torch.Tensor, weight_B: torch.Tensor, eps: float) -> torch.Tensor:
    """(v_i - mu) / (sigma + eps) over the batch, each sample weighted by weight_B (its trained
    token count, so the statistics are those of the token-level advantages, as REINFORCE++
    whitens them): with W = sum_i w_i,

      mu = sum_i w_i v_i / W,    sigma^2 = sum_i w_i (v_i - mu)^2 / (W - 1)
    W <= 1 gives sigma = 0; a zero denominator (sigma = eps = 0) gives 0."""
    values_B = values_B.float()
    weight_B = weight_B.to(values_B.dtype)
    total = weight_B.sum()
    mu = (weight_B * values_B).sum() / total.clamp(min=1)
    var = (weight_B * (values_B - mu).square()).sum() / (total - 1).clamp(min=1)
    denom = var.sqrt() + eps
    centred_B = values_B - mu
    return torch.where(denom > 0, centred_B / denom, torch.zeros_like(centred_B))


def compute_advantages(
    rewards_B: torch.Tensor,
    mask_BT: torch.Tensor,
    groups: int | torch.Tensor,
    cfg: GRPOConfig,
) -> torch.Tensor:
    """adv_B of `cfg.advantage_estimator`; `mask_BT` is the loss mask after filtering (it
    weights the batch whitening; masked-out samples do not count):

      grpo:                  (r - mean_g) / (std_g + eps), or r - mean_g without
                             normalize_advantage_by_std (Shao et al. 2024)
      dr_grpo:               r - mean_g (Liu et al. 2025; its loss side is loss_agg_mode
                             seq-mean-token-sum-norm, set by `GRPOConfig`)
      rloo:                  `rloo_advantages`
      reinforce_pp:          `whiten`(r): no group baseline (Hu 2025, REINFORCE++)
      reinforce_pp_baseline: `whiten`(r - mean_g) (REINFORCE++ with a group baseline)
    eps = advantage_eps. std_g is the unbiased group std (see `grpo.group_advantages`).
    """
    estimator = cfg.advantage_estimator
    if estimator == "grpo":
        return group_advantages(
            rewards_B, groups, normalize_by_std=cfg.normalize_advantage_by_std,
            eps=cfg.advantage_eps,
        )  # fmt: skip
    if estimator == "dr_grpo":
        return group_advantages(rewards_B, groups, normalize_by_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards_B, groups)
    tokens_B = mask_BT.sum(dim=-1)
    if estimator == "reinforce_pp":
        group_index(groups, rewards_B)  # the same checks of the batch's shape as the others
        return whiten(rewards_B, tokens_B, cfg.advantage_eps)
    if estimator == "reinforce_pp_baseline":
        centred_B = group_advantages(rewards_B, groups, normalize_by_std=False)
        return whiten(centred_B, tokens_B, cfg.advantage_eps)
    raise ValueError(f"unknown advantage_estimator {estimator!r}; expected {ADVANTAGE_ESTIMATORS}")
