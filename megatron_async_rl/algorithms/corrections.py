"""Off-policy corrections between the engine that sampled (behaviour) and the trainer, and the
engine-vs-trainer mismatch metrics.

Owned here: the detached per-token weight the surrogate is multiplied by
(`behaviour_weight`, `algorithm.off_policy_correction`), the rejection of tokens or sequences
whose ratio leaves a band (`behaviour_mask`, `algorithm.off_policy_mask`, with its metrics in
`rejection_metrics`) and `mismatch_metrics`. `losses.policy_loss` calls `behaviour_weight` per
micro-batch; `roles/learn.py:LearnSide.train` calls the others once per batch, before the
mini-batches are cut, so a rejected token leaves every denominator alike. Pure torch.

rho_t = exp(old_logp_t - behaviour_logp_t): old_logp is the `logp` role's (the trainer's, the
proximal policy of the decoupled objective), behaviour_logp the engine's. Both are data.

Shape suffixes: B samples, T response positions (a 0/1 or bool mask marks real tokens).
"""

from __future__ import annotations

import math

import torch

from megatron_async_rl.algorithms.config import GRPOConfig


def _log_rho(old_logp_BT, behaviour_logp_BT, mask_BT) -> torch.Tensor:
    log_rho_BT = (old_logp_BT - behaviour_logp_BT).detach()
    return torch.where(mask_BT.bool(), log_rho_BT, torch.zeros_like(log_rho_BT))


def behaviour_weight(
    old_logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor | None,
    mask_BT: torch.Tensor,
    cfg: GRPOConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached per-token weight w of `cfg.off_policy_correction`, and where rho hit the
    cap C = tis_cap:

      none:      w = 1
      tis_token: w = min(rho_t, C)                 (truncated IS per token; Yao et al. 2025)
      tis_seq:   w = min(prod_t rho_t, C)          (one weight per sequence, its real tokens)
      decoupled: w = rho_t if rho_t <= C else 0    (AReaL, Fu et al. 2025: over the cap dropped)
    """
    mode = cfg.off_policy_correction
    mask_BT = mask_BT.bool()
    if mode == "none":
        return torch.ones_like(old_logp_BT), torch.zeros_like(mask_BT)
    if behaviour_logp_BT is None:
        raise ValueError(
            f"off_policy_correction={mode!r} needs behaviour_logp_BT (the engine's log-probs)"
        )
    log_w_BT = _log_rho(old_logp_BT, behaviour_logp_BT, mask_BT)
    if mode == "tis_seq":
        log_w_BT = log_w_BT.sum(dim=-1, keepdim=True).expand_as(log_w_BT)
    log_cap = math.log(cfg.tis_cap)
    capped_BT = log_w_BT > log_cap
    weight_BT = log_w_BT.clamp(max=log_cap).exp()
    if mode == "decoupled":
        weight_BT = torch.where(capped_BT, torch.zeros_like(weight_BT), weight_BT)
    return weight_BT, capped_BT


def behaviour_mask(
    old_logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: GRPOConfig,
) -> torch.Tensor:
    """keep_BT (bool): False where `cfg.off_policy_mask` rejects, True elsewhere (padding too).

    With [lo, hi] = [off_policy_mask_low, off_policy_mask_high] and the sequence's real tokens:
      none:     nothing rejected
      token:    token t rejected if rho_t is outside [lo, hi]   (IcePop, inclusionAI's Ring-1T
                2025; token MIS, Liu, Li et al. 2025, "When speed kills stability")
      seq:      sequence rejected if prod_t rho_t is outside [lo, hi]
      geo_mean: sequence rejected if exp(mean_t log rho_t) is outside [lo, hi] (a length-free
                band, so its bounds can be tight, e.g. [0.999, 1.001])
    Compared in log space (lo = 0 accepts any small ratio). The caller multiplies the loss mask
    by keep_BT: a rejected token leaves the loss, its denominators and the KL/entropy terms
    (verl's rollout rejection sampling does the same).
    """
    mode = cfg.off_policy_mask
    if mode == "none":
        return torch.ones_like(mask_BT, dtype=torch.bool)
    mask_BT = mask_BT.bool()
    log_rho_BT = _log_rho(old_logp_BT, behaviour_logp_BT, mask_BT).double()
    if mode in ("seq", "geo_mean"):
        seq_B = log_rho_BT.sum(dim=-1)
        if mode == "geo_mean":
            seq_B = seq_B / mask_BT.sum(dim=-1).clamp(min=1)
        log_rho_BT = seq_B.unsqueeze(-1).expand_as(log_rho_BT)
    elif mode != "token":
        raise ValueError(f"unknown off_policy_mask {mode!r}")
    low = cfg.off_policy_mask_low
    log_low = math.log(low) if low > 0 else -math.inf
    return (log_rho_BT >= log_low) & (log_rho_BT <= math.log(cfg.off_policy_mask_high))


def rejection_metrics(mask_BT: torch.Tensor, keep_BT: torch.Tensor) -> dict[str, float]:
    """offpolicy/masked_token_frac: share of the real tokens of `mask_BT` that keep_BT rejects;
    offpolicy/masked_seq_frac: share of the sequences with real tokens that lose all of them."""
    mask_BT = mask_BT.bool()
    real_B = mask_BT.sum(-1) > 0
    lost_B = real_B & ((mask_BT & keep_BT).sum(-1) == 0)
    rejected = int((mask_BT & ~keep_BT).sum())
    return {
        "offpolicy/masked_token_frac": rejected / max(int(mask_BT.sum()), 1),
        "offpolicy/masked_seq_frac": int(lost_B.sum()) / max(int(real_B.sum()), 1),
    }


def mismatch_metrics(
    train_logp_BT: torch.Tensor,
    engine_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    suffix: str = "",
) -> dict[str, float]:
    """Engine-vs-trainer mismatch on the tokens of `mask_BT`, with d = engine_logp - train_logp
    per token (the tokens were sampled by the engine):

      mismatch/k1:      mean d                          (k1 estimate of KL(engine || trainer))
      mismatch/k3_kl:   mean exp(-d) - 1 + d            (k3: unbiased, >= 0; Schulman 2020)
      mismatch/max_abs: max |d|
    `suffix` is appended to each key (e.g. "/trained"). No tokens: all 0. Computed in float64.
    With a stale engine (the asynchronous loop) d also holds the policy's lag, not only numerics.
    """
    d = (engine_logp_BT.detach().double() - train_logp_BT.detach().double())[mask_BT.bool()]
    if d.numel() == 0:
        values = (0.0, 0.0, 0.0)
    else:
        values = (d.mean().item(), (torch.expm1(-d) + d).mean().item(), d.abs().max().item())
    return {f"mismatch/{name}{suffix}": v for name, v in zip(("k1", "k3_kl", "max_abs"), values)}
