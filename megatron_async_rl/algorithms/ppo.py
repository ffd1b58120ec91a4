"""PPO with a critic: token rewards, GAE, advantage whitening and the clipped value loss.

Owned here, in the order a PPO step uses them:

    seq rewards (+ turn rewards, - kl_coef * KL) --token_rewards--> rewards_BT
    rewards_BT, values_BT (the critic, before its update) --gae--> adv_BT, returns_BT
    adv_BT --whiten--> the actor's advantages        returns_BT --> value_loss (the critic's)
    values_BT, returns_BT --explained_variance--> critic/explained_var

`token_rewards`, `gae`, `whiten` and `explained_variance` run once per batch, before the
mini-batches are cut (their results are data to the losses, so they are exact under PPO
mini-batches and micro-batching); `value_loss` runs per micro-batch in the critic's loss
function and, given the optimizer step's global counts, its micro-batch losses sum to the
full-batch loss like `losses.aggregate`'s. The knobs are `algorithms.critic_config.CriticConfig`
(the recipe's `critic:` section). Pure torch: no collectives, no Megatron.

Shape suffixes: B samples, T positions. Column t of a [B, T] tensor here is the prediction of
token t+1 (the grid of the per-token log-probs), so values_BT[:, t] is the critic's value of the
state before the action at column t. `mask_BT` marks the model's (trained) tokens: 0 on the
prompt, on right padding and, in a multi-turn trajectory, on the environment's tokens inside the
response. Pass the model-token mask, before any off-policy rejection: rejection removes a token
from the policy loss, not from the return the other tokens see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_async_rl.algorithms.losses import aggregate

WHITEN_EPS = 1e-8
"""Added to the variance before the inverse square root in `whiten` (verl's masked_whiten)."""


def _masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum() / mask_BT.sum().clamp(min=1)


def token_rewards(
    seq_rewards_B: torch.Tensor,
    mask_BT: torch.Tensor,
    turn_rewards: Sequence[Sequence[tuple[int, float]]] | None = None,
    *,
    kl_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The per-token reward r_it that `gae` discounts (float32, 0 off the trained tokens):

      r_it = [t = last_i] R_i + sum_{(t, q) in turn_rewards[i]} q - kl_coef * kl_it   (m_it = 1)

    with last_i the last trained column of sample i (its terminal token) and R_i its sequence
    reward. A sample with no trained token gets no reward (it is not trained).

    turn_rewards: per-turn rewards of multi-turn trajectories, one list per sample (B lists) of
    (column, reward) pairs, the column being that of the turn's last model token on the grid
    of `mask_BT`; rewards on one column add. They are added to R_i, so a caller that has per-turn
    rewards whose sum is the trajectory's reward (`Episode.rewards`) passes them here and zeros
    (or only an outcome bonus) as `seq_rewards_B`. A column off the grid or on a token that is
    not trained raises ValueError (`gae` skips such tokens, so the reward would be lost).

    KL in the reward (the InstructGPT / OpenRLHF form of kl_mode "reward", per token rather
    than `grpo.kl_reward`'s per-sequence sum): kl_BT = `grpo.kl_penalty(old_logp, ref_logp,
    estimator)`, detached; each trained token pays kl_coef * kl_it, so the penalty for
    drifting from the reference is credited to the token that drifted.
    """
    mask_BT = mask_BT.bool()
    num_samples, num_positions = mask_BT.shape
    if seq_rewards_B.shape != (num_samples,):
        raise ValueError(
            f"seq_rewards_B has shape {tuple(seq_rewards_B.shape)}; expected ({num_samples},)"
        )
    rewards_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    if num_positions:
        columns_T = torch.arange(num_positions, device=mask_BT.device)
        last_B = torch.where(mask_BT, columns_T, -1).amax(dim=-1)  # -1: nothing trained
        seq_rewards_B = seq_rewards_B.detach().float().to(mask_BT.device)
        terminal_B = torch.where(last_B >= 0, seq_rewards_B, 0.0)
        rows_B = torch.arange(num_samples, device=mask_BT.device)
        rewards_BT[rows_B, last_B.clamp(min=0)] += terminal_B
    if turn_rewards is not None:
        rewards_BT = rewards_BT + _turn_rewards_BT(turn_rewards, mask_BT)
    if kl_BT is not None and kl_coef:
        if kl_BT.shape != mask_BT.shape:
            raise ValueError(
                f"kl_BT has shape {tuple(kl_BT.shape)}; expected {tuple(mask_BT.shape)}"
            )
        penalty_BT = kl_coef * kl_BT.detach().float()
        rewards_BT = rewards_BT - torch.where(mask_BT, penalty_BT, torch.zeros_like(penalty_BT))
    return rewards_BT


def _turn_rewards_BT(
    turn_rewards: Sequence[Sequence[tuple[int, float]]], mask_BT: torch.Tensor
) -> torch.Tensor:
    """The turn rewards scattered onto a [B, T] float32 grid, each column checked."""
    num_samples, num_positions = mask_BT.shape
    if len(turn_rewards) != num_samples:
        raise ValueError(f"turn_rewards has {len(turn_rewards)} lists; expected {num_samples}")
    mask_rows = mask_BT.cpu().tolist()
    rows, columns, values = [], [], []
    for i, turns in enumerate(turn_rewards):
        for column, reward in turns:
            if not 0 <= column < num_positions or not mask_rows[i][column]:
                raise ValueError(
                    f"turn reward of sample {i} at column {column}: must be a trained column "
                    f"(mask 1) in [0, {num_positions}), the turn's last model token"
                )
            rows.append(i)
            columns.append(column)
            values.append(float(reward))
    grid_BT = torch.zeros(mask_BT.shape, dtype=torch.float32)
    if rows:
        index = (torch.tensor(rows), torch.tensor(columns))
        grid_BT.index_put_(index, torch.tensor(values, dtype=torch.float32), accumulate=True)
    return grid_BT.to(mask_BT.device)


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over the trained tokens;
    returns (adv_BT, returns_BT), float32, detached, 0 off the trained tokens.

    With t_1 < ... < t_n the trained columns of a sample (its model tokens; environment tokens
    inside the response and right padding are skipped), k indexing them:

      delta_k = r_{t_k} + gamma V_{t_{k+1}} - V_{t_k}      V_{t_{n+1}} = 0 (terminal)
      A_k     = delta_k + gamma lam A_{k+1}                  A_{n+1} = 0
      R_k     = A_k + V_{t_k}
    so the recursion links each model token to the next model token of the same sample, and
    rewards and values off the trained tokens are never read (they may be NaN). gamma = lam = 1
    gives A_k = (sum_{j >= k} r_{t_j}) - V_{t_k}, the reward-to-go minus the value.

    Cost: one backward loop over T of about 8 elementwise ops on [B] vectors, O(B T) work in
    T sequential steps, once per batch: 0.2 s for B = 256, T = 4096 on 2 CPU cores; on a GPU
    it is bound by the ~8 T small kernel launches. A closed-form cumulative sum would need
    (gamma lam)^-t, which overflows float32 within a few thousand tokens, hence the loop.
    """
    mask_BT = mask_BT.bool()
    if rewards_BT.shape != mask_BT.shape or values_BT.shape != mask_BT.shape:
        raise ValueError(
            f"rewards_BT {tuple(rewards_BT.shape)}, values_BT {tuple(values_BT.shape)} and "
            f"mask_BT {tuple(mask_BT.shape)} must have one shape"
        )
    zeros_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    rewards_BT = torch.where(mask_BT, rewards_BT.detach().float(), zeros_BT)
    values_BT = torch.where(mask_BT, values_BT.detach().float(), zeros_BT)
    next_value_B = next_adv_B = zeros_BT.new_zeros(mask_BT.shape[0])
    adv_columns = []
    for t in reversed(range(mask_BT.shape[1])):
        trained_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + (gamma * lam) * next_adv_B
        # An untrained column passes the next model token's value and advantage through.
        next_adv_B = torch.where(trained_B, adv_B, next_adv_B)
        next_value_B = torch.where(trained_B, values_BT[:, t], next_value_B)
        adv_columns.append(torch.where(trained_B, adv_B, zeros_BT[:, t]))
    adv_BT = torch.stack(adv_columns[::-1], dim=1) if adv_columns else zeros_BT
    return adv_BT, torch.where(mask_BT, adv_BT + values_BT, zeros_BT)


def whiten(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, shift_mean: bool = True, *, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """(x - mu) / sqrt(var + eps) over the trained tokens of the batch (float32, 0 elsewhere),
    verl's masked_whiten and OpenRLHF's advantage normalisation: with N trained tokens,

      mu = sum_it m_it x_it / N,    var = sum_it m_it (x_it - mu)^2 / (N - 1)   (unbiased)
    shift_mean False adds mu back (the scale changes, the mean does not). N <= 1 gives var 0
    (and a lone token x - mu = 0). Unlike `advantages.whiten` (per-sample advantages, token
    weighted, sigma + eps) this whitens per-token values. Statistics are those of the tensors
    given: pass the whole batch, before mini-batches are cut.
    """
    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    x_BT = torch.where(mask_BT, x_BT.float(), zeros_BT)
    count = mask_BT.sum()
    mu = x_BT.sum() / count.clamp(min=1)
    centred_BT = torch.where(mask_BT, x_BT - mu, zeros_BT)
    var = centred_BT.square().sum() / (count - 1).clamp(min=1)
    whitened_BT = centred_BT * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mu
    return torch.where(mask_BT, whitened_BT, zeros_BT)


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float | None,
    mode: str,
    *,
    num_tokens_global: int | torch.Tensor | None = None,
    num_seqs_global: int | torch.Tensor | None = None,
    token_sum_norm: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss and metrics. Per token, with V the value being trained, V_old the
    critic's value when the batch was scored (data), R the return (data) and c = clip:

      l = 0.5 (V - R)^2                                                    clip None
      l = 0.5 max((V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2)      PPO2 value clipping
    aggregated by `losses.aggregate(l, mask, mode, ...)` with the same counts: given the
    optimizer step's global token / sequence counts, micro-batch losses sum to the full-batch
    loss, in every mode (`token_sum_norm`, the response budget, for seq-mean-token-sum-norm).
    Where the clipped error is the larger, the gradient is 0 (V is clamped). `old_values_BT`
    and `returns_BT` are data (detached); off the trained tokens they are never read.

    Metrics (detached 0-d tensors, over this micro-batch's trained tokens): critic/value_loss
    (the aggregated loss), critic/clip_frac (tokens whose clipped error is the larger),
    critic/values_mean and critic/returns_mean.
    """
    mask_BT = mask_BT.bool()
    values_BT = values_BT.float()
    zeros_BT = torch.zeros_like(values_BT)
    # Data off the trained tokens may be NaN: zeroed, so no NaN reaches V's gradient there.
    returns_BT = torch.where(mask_BT, returns_BT.detach().float(), zeros_BT)
    error_BT = (values_BT - returns_BT).square()
    clipped_BT = torch.zeros_like(mask_BT)
    if clip is not None:
        old_values_BT = torch.where(mask_BT, old_values_BT.detach().float(), zeros_BT)
        clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
        clipped_error_BT = (clipped_values_BT - returns_BT).square()
        clipped_BT = clipped_error_BT > error_BT
        error_BT = torch.maximum(error_BT, clipped_error_BT)
    loss = aggregate(
        0.5 * error_BT,
        mask_BT,
        mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        token_sum_norm=token_sum_norm,
    )
    with torch.no_grad():
        metrics = {
            "critic/value_loss": loss.detach(),
            "critic/clip_frac": _masked_mean(clipped_BT.float(), mask_BT),
            "critic/values_mean": _masked_mean(values_BT.detach(), mask_BT),
            "critic/returns_mean": _masked_mean(returns_BT, mask_BT),
        }
    return loss, metrics


def explained_variance(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """critic/explained_var: 1 - Var(R - V) / Var(R) over the trained tokens (a detached 0-d
    float32 tensor). 1: perfect values; 0: no better than the mean return; below 0: worse.
    Both variances are unbiased over the same N tokens (the correction cancels). Undefined,
    NaN (the metrics writer records null), when Var(R) = 0 or N < 2."""
    mask_BT = mask_BT.bool()
    values_N = values_BT.detach().float()[mask_BT]
    returns_N = returns_BT.detach().float()[mask_BT]
    if returns_N.numel() < 2:
        return torch.tensor(math.nan, device=mask_BT.device)
    var_returns = returns_N.var()
    explained = 1 - (returns_N - values_N).var() / var_returns
    return torch.where(var_returns > 0, explained, torch.full_like(explained, math.nan))
