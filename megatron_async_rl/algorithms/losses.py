"""The loss the train role minimises, computed per micro-batch on the last pipeline stage.

Owned here: loss aggregation (`aggregate`), the clipped surrogate, token-level PPO or
sequence-level GSPO, weighted by the off-policy correction of `algorithms.corrections`
(`policy_loss`) and the total loss with the KL and entropy terms (`total_loss`).
The train role calls `total_loss` from its Megatron loss function with per-token log-probs from
`algorithms.logprobs.vocab_parallel_logprobs` (differentiable) and, as data, the `logp` role's
log-probs (old/proximal), the engine's (behaviour) and the `ref` role's. Pure torch.

Gradient accumulation: pass `num_tokens_global` / `num_seqs_global` (counted over every
micro-batch of the optimizer step) and the micro-batch losses sum to the full-batch loss. Rows
are whole sequences, so GSPO's per-sequence ratio and tis_seq's weight are exact too.

Shape suffixes: B samples, T response positions (a 0/1 or bool mask marks real tokens).
"""

from __future__ import annotations

import math

import torch

from megatron_async_rl.algorithms.corrections import behaviour_weight
from megatron_async_rl.algorithms.grpo import LOSS_AGG_MODES, GRPOConfig, kl_penalty

PPO_LOG_RATIO_BOUND = 20.0
"""log(pi / pi_old) is clamped to +-20 before exp, so a padded or wild token cannot overflow."""


def _masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    total = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()
    return total / mask_BT.sum().clamp(min=1)


def _masked_max(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    # No `if mask.any()`: that would synchronise with the GPU on every micro-batch.
    if x_BT.numel() == 0:
        return x_BT.new_zeros(())
    top = torch.where(mask_BT, x_BT, torch.full_like(x_BT, -math.inf)).max()
    return torch.where(mask_BT.any(), top, torch.zeros_like(top))


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    num_tokens_global: int | torch.Tensor | None = None,
    num_seqs_global: int | torch.Tensor | None = None,
    token_sum_norm: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar; padded positions never contribute (even NaN).

    With m_it the mask, n_i = sum_t m_it, S the sequences with n_i > 0:
      token-mean:              sum_it m_it l_it / N          N = num_tokens_global or sum m_it
      seq-mean-token-mean:     sum_i (sum_t m_it l_it / n_i) / S
      seq-mean-token-sum:      sum_i (sum_t m_it l_it) / S   S = num_seqs_global or |S|
      seq-mean-token-sum-norm: sum_i (sum_t m_it l_it) / (S L)   L = token_sum_norm, a constant
    The last is Dr. GRPO's (Liu et al. 2025, "Understanding R1-Zero-like training"): no
    per-sequence length normalisation, and a constant L (the generation budget) in place of the
    lengths, so the loss scale stays near token-mean's; verl calls it seq-mean-token-sum-norm.
    Given the counts of the whole optimizer step, the micro-batch results sum to the full-batch
    result (up to float summation order). A denominator of 0 is taken as 1, giving 0.
    """
    mask_BT = mask_BT.bool()
    masked_BT = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))
    if mode == "token-mean":
        total, count = masked_BT.sum(), num_tokens_global
        if count is None:
            count = mask_BT.sum()
    elif mode in LOSS_AGG_MODES:
        num_tokens_B = mask_BT.sum(dim=-1)
        seq_B = masked_BT.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            seq_B = seq_B / num_tokens_B.clamp(min=1)
        total, count = seq_B.sum(), num_seqs_global
        if count is None:
            count = (num_tokens_B > 0).sum()
        if mode == "seq-mean-token-sum-norm":
            if token_sum_norm is None or token_sum_norm < 1:
                raise ValueError(f"{mode} needs token_sum_norm >= 1, got {token_sum_norm!r}")
            total = total / token_sum_norm
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return total / count.clamp(min=1)


def _ratio(logp_BT, old_logp_BT, mask_BT, policy_loss: str) -> torch.Tensor:
    """ppo: r_t = exp(logp_t - old_logp_t). gspo: s_i = exp(mean_t (logp - old_logp)) over the
    sequence's real tokens, in GSPO's token form s_it = sg[s_i] * pi_t / sg[pi_t] (value s_i,
    gradient s_i * grad log pi_t). The log-ratio is clamped to +-20 before exp."""
    log_ratio_BT = logp_BT - old_logp_BT
    if policy_loss == "gspo":
        zeros_BT = torch.zeros_like(log_ratio_BT)
        seq_B = torch.where(mask_BT, log_ratio_BT, zeros_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
        log_ratio_BT = seq_B.detach().unsqueeze(-1) + (logp_BT - logp_BT.detach())
    elif policy_loss != "ppo":
        raise ValueError(f"unknown policy_loss {policy_loss!r}")
    return log_ratio_BT.clamp(-PPO_LOG_RATIO_BOUND, PPO_LOG_RATIO_BOUND).exp()


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: GRPOConfig,
    behaviour_logp_BT: torch.Tensor | None = None,
    *,
    num_tokens_global: int | torch.Tensor | None = None,
    num_seqs_global: int | torch.Tensor | None = None,
    token_sum_norm: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate, aggregated by `cfg.loss_agg_mode`; returns (loss, metrics).

    Per token, with r the ratio of `cfg.policy_loss`, A the advantage (the sample's [B], or the
    token's [B, T] of PPO with a critic, `algorithms.ppo`), eps_l / eps_h
    the clips:
      ppo:  r = exp(logp_t - old_logp_t)
      gspo: r = s_i = exp(mean_t (logp - old_logp)) over sequence i's real tokens, in the
            token form sg[s_i] pi_t / sg[pi_t] of Zheng et al. 2025 (GSPO), so the clip acts on
            the sequence and the gradient is s_i A grad log pi_t; with seq-mean-token-mean
            (the only mode it accepts) this is GSPO's objective exactly
      pg = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))
      dual-clip (clip_ratio_c = c, tokens with A < 0): pg = min(pg, -A c)
      pg *= w, w the detached behaviour weight of `cfg.off_policy_correction`
      (`corrections.behaviour_weight`: none, tis_token, tis_seq or decoupled).
    `old_logp` is the `logp` role's (the proximal policy in the decoupled objective), so
    decoupled is J = E_behaviour[pi_prox / pi_behav * min(r A, clip(r) A)]: the trust region is
    around the proximal policy, not the stale behaviour policy. Dropped tokens stay in the
    denominators. `old_logp_BT` and `behaviour_logp_BT` are data (detached).

    Metrics (detached 0-d tensors, over this micro-batch's real tokens): actor/pg_loss,
    actor/clip_frac (the clipped branch is the max), actor/dual_clip_frac, actor/ppo_kl
    (mean old_logp - logp), actor/ratio_mean, actor/ratio_max, offpolicy/is_weight_mean and
    offpolicy/is_weight_max (the applied w), offpolicy/capped_frac (tokens whose rho hit C);
    with behaviour_logp_BT also offpolicy/logp_gap_mean and offpolicy/logp_abs_gap_mean
    (old_logp - behaviour_logp: the train/engine log-prob gap).
    """
    mask_BT = mask_BT.bool()
    old_logp_BT = old_logp_BT.detach()
    adv = adv_B.detach().to(logp_BT.dtype)  # [B] per sample, or [B, T] per token (PPO's GAE)
    adv_BT = adv if adv.dim() == 2 else adv.unsqueeze(-1)
    ratio_BT = _ratio(logp_BT, old_logp_BT, mask_BT, cfg.policy_loss)
    pg_unclipped_BT = -adv_BT * ratio_BT
    clipped_ratio_BT = ratio_BT.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg_clipped_BT = -adv_BT * clipped_ratio_BT
    pg_BT = torch.maximum(pg_unclipped_BT, pg_clipped_BT)
    dual_BT = torch.zeros_like(mask_BT)
    if cfg.clip_ratio_c is not None:
        pg_dual_BT = (-adv_BT * cfg.clip_ratio_c).expand_as(pg_BT)
        dual_BT = (adv_BT < 0) & (pg_dual_BT < pg_BT)
        pg_BT = torch.where(dual_BT, pg_dual_BT, pg_BT)
    weight_BT, capped_BT = behaviour_weight(old_logp_BT, behaviour_logp_BT, mask_BT, cfg)
    loss = aggregate(
        pg_BT * weight_BT,
        mask_BT,
        cfg.loss_agg_mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        token_sum_norm=token_sum_norm,
    )

    with torch.no_grad():
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/clip_frac": _masked_mean((pg_clipped_BT > pg_unclipped_BT).float(), mask_BT),
            "actor/dual_clip_frac": _masked_mean(dual_BT.float(), mask_BT),
            "actor/ppo_kl": _masked_mean(old_logp_BT - logp_BT, mask_BT),
            "actor/ratio_mean": _masked_mean(ratio_BT, mask_BT),
            "actor/ratio_max": _masked_max(ratio_BT, mask_BT),
            "offpolicy/is_weight_mean": _masked_mean(weight_BT, mask_BT),
            "offpolicy/is_weight_max": _masked_max(weight_BT, mask_BT),
            "offpolicy/capped_frac": _masked_mean(capped_BT.float(), mask_BT),
        }
        if behaviour_logp_BT is not None:
            gap_BT = old_logp_BT - behaviour_logp_BT
            metrics["offpolicy/logp_gap_mean"] = _masked_mean(gap_BT, mask_BT)
            metrics["offpolicy/logp_abs_gap_mean"] = _masked_mean(gap_BT.abs(), mask_BT)
    return loss, metrics


def total_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: GRPOConfig,
    *,
    behaviour_logp_BT: torch.Tensor | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    num_tokens_global: int | torch.Tensor | None = None,
    num_seqs_global: int | torch.Tensor | None = None,
    token_sum_norm: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg + kl_coef * KL (kl_mode == "loss") - entropy_coef * entropy, each term aggregated by
    `cfg.loss_agg_mode` with the same counts (and `token_sum_norm`, the response budget, for
    seq-mean-token-sum-norm); returns (loss, metrics).

    KL is `kl_penalty(logp, ref_logp, cfg.kl_estimator)`, differentiated through logp only.
    `ref_logp_BT` is required when the KL term is on, `entropy_BT` (differentiable, from
    `vocab_parallel_logprobs`) when entropy_coef > 0; given otherwise, they only feed metrics.
    Metrics: those of `policy_loss`, actor/loss, kl/mean and actor/kl_loss, entropy/mean and
    actor/entropy_loss (the means are over this micro-batch's real tokens).
    """
    loss, metrics = policy_loss(
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        cfg,
        behaviour_logp_BT,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        token_sum_norm=token_sum_norm,
    )
    mask_BT = mask_BT.bool()
    counts = {
        "num_tokens_global": num_tokens_global,
        "num_seqs_global": num_seqs_global,
        "token_sum_norm": token_sum_norm,
    }
    kl_in_loss = cfg.kl_mode == "loss" and cfg.kl_coef > 0
    if kl_in_loss and ref_logp_BT is None:
        raise ValueError("kl_coef > 0 with kl_mode='loss' needs ref_logp_BT (the ref role's)")
    if ref_logp_BT is not None:
        kl_BT = kl_penalty(logp_BT, ref_logp_BT.detach(), cfg.kl_estimator)
        metrics["kl/mean"] = _masked_mean(kl_BT.detach(), mask_BT)
        if kl_in_loss:
            kl_term = aggregate(kl_BT, mask_BT, cfg.loss_agg_mode, **counts)
            loss = loss + cfg.kl_coef * kl_term
            metrics["actor/kl_loss"] = kl_term.detach()
    if cfg.entropy_coef > 0 and entropy_BT is None:
        raise ValueError("entropy_coef > 0 needs entropy_BT (vocab_parallel_logprobs computes it)")
    if entropy_BT is not None:
        metrics["entropy/mean"] = _masked_mean(entropy_BT.detach(), mask_BT)
        if cfg.entropy_coef > 0:
            entropy_term = aggregate(entropy_BT, mask_BT, cfg.loss_agg_mode, **counts)
            loss = loss - cfg.entropy_coef * entropy_term
            metrics["actor/entropy_loss"] = entropy_term.detach()
    metrics["actor/loss"] = loss.detach()
    return loss, metrics
