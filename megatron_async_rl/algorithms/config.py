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

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
KL_MODES = ("loss", "reward")
OFF_POLICY_CORRECTIONS = ("none", "tis_token", "tis_seq", "decoupled")
REFILL_EXHAUSTED = ("pad", "error")
OFF_POLICY_MASKS = ("none", "token", "seq", "geo_mean")
OLD_LOGPROBS = ("auto", "logp", "trainer", "engine")
POLICY_LOSSES = ("ppo", "gspo")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
DR_GRPO_AGG_MODES = ("seq-mean-token-sum-norm", "seq-mean-token-sum")
"""Dr. GRPO drops the per-sequence length normalisation: a sequence's loss is its token sum."""

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
    """GRPO: divide by the group's (unbiased) std. False: Dr. GRPO-style r - mean only. Read by
    advantage_estimator grpo only (the others define their own scale)."""
    advantage_eps: float = 1e-6
    """Added to the group std before dividing."""
    clip_ratio_low: float = 0.2
    """The ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """The ratio is clipped above at 1 + clip_ratio_high (DAPO clip-higher: e.g. 0.28)."""
    clip_ratio_c: float | None = None
    """Dual-clip: a negative-advantage token's loss is at most c * |A|. None: off; 3.0 is usual."""
    loss_agg_mode: str | None = None
    """token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm (see
    `losses.aggregate`). None: the one the policy loss and estimator define (gspo:
    seq-mean-token-mean, dr_grpo: seq-mean-token-sum-norm, else token-mean); stored resolved."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy; 0 disables it (and the ref role is not needed:
    place none, and no reference model is loaded or run)."""
    kl_metrics_every: int = 1
    """With a placed ref role and no KL term (kl_coef 0): its pass runs every this many steps,
    for the kl/* metrics alone; 0: never (the dry run then warns that nothing uses the role)."""
    old_logprobs: str = "auto"
    """Where the old log-probs of the PPO ratio come from: logp (the logp role's pass), trainer
    (the train forward's own, detached: exact for one optimizer step at zero steps ahead, no
    extra pass), engine (the engine's, the behaviour policy: no extra pass), or auto (logp where
    placed, else trainer where exact, else engine); stored resolved (`algorithms.passes`)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (alias low_var_kl, stored as k3); see `kl_penalty`."""
    kl_mode: str = "loss"
    """loss: kl_coef * KL is added to the loss; reward: subtracted from the sequence reward."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the loss subtracts entropy_coef * entropy)."""
    dynamic_filtering: bool = False
    """DAPO: drop groups whose rewards all agree (zero variance, zero advantage)."""
    refill: bool = False
    """DAPO dynamic sampling: the generate side samples more prompts (rounds of
    rollout.num_prompts_per_step) until a step holds exactly num_prompts_per_step groups whose
    rewards differ; needs dynamic_filtering (`rollout/refill.py`)."""
    max_refill_rounds: int = 10
    """Refill rounds a step may draw after its first (DAPO's max_num_gen_batches - 1)."""
    refill_exhausted: str = "pad"
    """After max_refill_rounds still short: pad (fill the batch with zero-variance groups, which
    dynamic_filtering masks out; warned and counted) or error (stop the run)."""
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
    policy_loss: str = "ppo"
    """ppo: the token-level clipped surrogate. gspo (Zheng et al. 2025, "Group Sequence Policy
    Optimization"): one length-normalised ratio per sequence, clipped per sequence; its clips are
    tiny (the paper: clip_ratio_low 3e-4, clip_ratio_high 4e-4). See `losses.policy_loss`."""
    advantage_estimator: str = "grpo"
    """grpo (group mean and std); dr_grpo (Liu et al. 2025: r - group mean, and a loss without
    per-sequence length normalisation); rloo (Ahmadian et al. 2024: leave-one-out group mean);
    reinforce_pp (Hu 2025, REINFORCE++: the batch's rewards whitened, no group baseline);
    reinforce_pp_baseline (r - group mean, then whitened over the batch); gae (PPO: per-token
    GAE from a `critic` role's values, Schulman et al. 2016; the recipe's `critic:` section).
    See `algorithms.advantages` and `algorithms.ppo`."""
    off_policy_mask: str = "none"
    """Rejection of tokens or sequences whose behaviour ratio rho = exp(old_logp -
    behaviour_logp) leaves [off_policy_mask_low, off_policy_mask_high]: none; token (IcePop /
    token MIS: the token); seq (the sequence, by prod_t rho_t); geo_mean (the sequence, by
    exp(mean_t log rho_t)). Rejected tokens leave the loss mask (`corrections.behaviour_mask`)."""
    off_policy_mask_low: float = 0.5
    """Lower bound of the accepted band of rho (in [0, 1]: rho = 1, on-policy, is kept)."""
    off_policy_mask_high: float = 2.0
    """Upper bound of the accepted band of rho (>= 1)."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment: responses longer than L_max - overlong_buffer_len lose
    reward linearly, up to overlong_penalty_factor at L_max (rollout.max_new_tokens, or
    environment.max_total_tokens for multi-turn). 0: off. See `advantages.overlong_penalty`."""
    overlong_penalty_factor: float = 1.0
    """The reward a response of L_max tokens (or more) loses."""
    mask_truncated: bool = False
    """DAPO overlong filtering: responses cut by the length limit (finish reason `length`) are
    not trained (loss mask 0); they still count in their group's advantage statistics."""

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
        self._resolve_loss_agg_mode()
        require_number("kl_coef", self.kl_coef, ge=0)
        require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.kl_estimator == "low_var_kl":
            self.kl_estimator = "k3"
        require_choice("kl_mode", self.kl_mode, KL_MODES)
        require_int("kl_metrics_every", self.kl_metrics_every, 0, hint="0: never")
        require_choice("old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        require_number("entropy_coef", self.entropy_coef, ge=0)
        require_bool("dynamic_filtering", self.dynamic_filtering)
        if self.dynamic_filtering and n == 1:
            raise ConfigError(
                "dynamic_filtering",
                True,
                "needs num_samples_per_prompt >= 2",
                "a group of one sample has zero variance, so every group would be dropped",
            )
        require_bool("refill", self.refill)
        require_int("max_refill_rounds", self.max_refill_rounds, 1,
                    hint="each round draws rollout.num_prompts_per_step more prompts")
        require_choice("refill_exhausted", self.refill_exhausted, REFILL_EXHAUSTED)
        if self.refill and not self.dynamic_filtering:
            raise ConfigError(
                "refill", True, "needs dynamic_filtering: true",
                "refill replaces the zero-variance groups dynamic filtering drops",
            )  # fmt: skip
        require_choice("off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        require_number(
            "tis_cap",
            self.tis_cap,
            ge=1,
            hint="a cap below 1 would shrink even on-policy tokens (weight 1)",
        )
        require_int("ppo_epochs", self.ppo_epochs, 1)
        require_bool("shuffle_minibatches", self.shuffle_minibatches)
        require_choice("off_policy_mask", self.off_policy_mask, OFF_POLICY_MASKS)
        band = "rho = 1 (an on-policy token) must stay inside the accepted band"
        require_number("off_policy_mask_low", self.off_policy_mask_low, ge=0, le=1, hint=band)
        require_number("off_policy_mask_high", self.off_policy_mask_high, ge=1, hint=band)
        require_int("overlong_buffer_len", self.overlong_buffer_len, 0, hint="0 turns it off")
        require_number("overlong_penalty_factor", self.overlong_penalty_factor, ge=0)
        require_bool("mask_truncated", self.mask_truncated)

    def _resolve_loss_agg_mode(self) -> None:
        """Validate policy_loss and advantage_estimator, and set loss_agg_mode from them when it
        is None; refuse a mode that contradicts their objective."""
        require_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        require_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        gspo, dr_grpo = self.policy_loss == "gspo", self.advantage_estimator == "dr_grpo"
        if gspo and self.advantage_estimator == "gae":
            raise ConfigError(
                "advantage_estimator", "gae",
                "cannot be combined with policy_loss gspo: GSPO weighs a sequence ratio by one "
                "advantage per sequence, GAE gives one per token",
                "use policy_loss ppo with a critic",
            )  # fmt: skip
        if gspo and dr_grpo:
            raise ConfigError(
                "advantage_estimator", "dr_grpo",
                "cannot be combined with policy_loss gspo: GSPO's sequence ratio and loss are "
                "length-normalised by definition, the normalisation Dr. GRPO removes",
                "use advantage_estimator grpo with normalize_advantage_by_std: false",
            )  # fmt: skip
        if self.loss_agg_mode is None:
            own = "seq-mean-token-mean" if gspo else DR_GRPO_AGG_MODES[0] if dr_grpo else None
            self.loss_agg_mode = own or "token-mean"
        own_mode = "or null: the mode policy_loss and advantage_estimator define"
        require_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES, hint=own_mode)
        if gspo and self.loss_agg_mode != "seq-mean-token-mean":
            raise ConfigError(
                "loss_agg_mode", self.loss_agg_mode,
                "must be seq-mean-token-mean with policy_loss gspo: GSPO's objective is the mean "
                "over sequences of each sequence's clipped ratio times its advantage",
                "leave loss_agg_mode out (null)",
            )  # fmt: skip
        if dr_grpo and self.loss_agg_mode not in DR_GRPO_AGG_MODES:
            raise ConfigError(
                "loss_agg_mode", self.loss_agg_mode,
                f"must be {' or '.join(DR_GRPO_AGG_MODES)} with advantage_estimator dr_grpo: Dr. "
                "GRPO sums each sequence's token losses (no per-sequence length normalisation)",
                "leave loss_agg_mode out (null)",
            )  # fmt: skip


def response_budget(run_cfg) -> tuple[str, int]:
    """L_max, the most tokens a response can hold, and the key that sets it: the multi-turn
    trajectory budget `environment.max_total_tokens`, else `rollout.max_new_tokens`. It is the
    overlong penalty's L_max and seq-mean-token-sum-norm's constant denominator."""
    if run_cfg.environment.multi_turn:
        return "environment.max_total_tokens", run_cfg.environment.max_total_tokens
    return "rollout.max_new_tokens", run_cfg.rollout.max_new_tokens


def check_overlong_budget(algo: GRPOConfig, budget_key: str, budget: int) -> None:
    """ConfigError when algorithm.overlong_buffer_len exceeds L_max (the punishment would start
    before a response has any token)."""
    if algo.overlong_buffer_len > budget:
        raise ConfigError(
            "algorithm.overlong_buffer_len", algo.overlong_buffer_len,
            f"must be at most {budget_key} = {budget} (the punishment starts "
            f"overlong_buffer_len tokens before that limit)",
            f"use a buffer below {budget}, e.g. {max(budget // 4, 1)}",
        )  # fmt: skip
