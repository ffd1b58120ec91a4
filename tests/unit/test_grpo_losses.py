"""Loss aggregation, the PPO clipped surrogate and the total loss, against formulas written here.

Contract: `aggregate` implements token-mean, seq-mean-token-mean, seq-mean-token-sum and
seq-mean-token-sum-norm (Dr. GRPO: token sums over S x a constant L), ignores padded positions,
and with the step's global token/sequence counts its micro-batch results sum to the full-batch
result (losses and gradients), for every loss mode, policy loss (ppo, gspo), off-policy weight
and rejection mask; `policy_loss` picks max(-A r, -A clip(r)) with separate low/high clips, zero
gradient on the clipped side, dual-clip for A < 0, and the tis_token / tis_seq / decoupled
weights (capped, detached); with gspo, r is the sequence's exp(mean_t log ratio), clipped per
sequence, and the loss and gradient equal GSPO's sequence-level objective written directly;
`total_loss` adds kl_coef * KL (kl_mode "loss") and subtracts entropy_coef * entropy. Ratios are
chosen to hit each branch and expected values are computed by hand. Nothing is faked.
"""

import math

import pytest
import torch

from megatron_async_rl.algorithms.corrections import behaviour_mask
from megatron_async_rl.algorithms.grpo import GRPOConfig
from megatron_async_rl.algorithms.losses import aggregate, policy_loss, total_loss

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
NORM = 8  # seq-mean-token-sum-norm's constant L (the run's response budget)


def test_aggregate_modes_by_hand():
    nan = float("nan")
    loss = torch.tensor([[1.0, 2.0, 3.0, nan], [4.0, 5.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == 15.0 / 5
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == (2.0 + 4.5) / 2
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == (6.0 + 9.0) / 2
    assert aggregate(loss, mask, "token-mean", num_tokens_global=10).item() == 1.5
    assert aggregate(loss, mask, "seq-mean-token-sum", num_seqs_global=5).item() == 3.0
    norm = aggregate(loss, mask, "seq-mean-token-sum-norm", token_sum_norm=4)
    assert norm.item() == (6.0 + 9.0) / (2 * 4)
    norm = aggregate(loss, mask, "seq-mean-token-sum-norm", num_seqs_global=5, token_sum_norm=3)
    assert norm.item() == (6.0 + 9.0) / (5 * 3)
    for mode in MODES:
        assert aggregate(loss, torch.zeros_like(mask), mode, token_sum_norm=NORM).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-mean'"):
        aggregate(loss, mask, "seq-mean")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm needs token_sum_norm >= 1"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, uniform=False):
        sample = torch.rand if uniform else torch.randn
        return sample(*shape, generator=gen, dtype=torch.float64)

    lengths = torch.tensor([5, 2, 0, 4, 1, 3])  # one sample with no real token
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    old = -2 * draw(6, 5, uniform=True)
    logp, ref, behaviour = old + 0.4 * draw(6, 5), old + 0.3 * draw(6, 5), old + 0.5 * draw(6, 5)
    return logp, old, ref, behaviour, draw(6, 5, uniform=True), draw(6), mask


VARIANTS = [
    *({"loss_agg_mode": mode, "off_policy_correction": "tis_token"} for mode in MODES),
    {"policy_loss": "gspo", "off_policy_correction": "tis_seq"},
    {"policy_loss": "gspo", "off_policy_mask": "seq", "off_policy_mask_high": 3.0},
    {"advantage_estimator": "dr_grpo", "off_policy_correction": "decoupled"},
    {"off_policy_mask": "token", "off_policy_correction": "tis_seq"},
    {
        "loss_agg_mode": "seq-mean-token-mean",
        "off_policy_mask": "geo_mean",
        "off_policy_mask_low": 0.8,
        "off_policy_mask_high": 1.2,
    },
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch(variant):
    logp, old, ref, behaviour, entropy, adv, mask = _batch(seed=3)
    cfg = GRPOConfig(clip_ratio_c=3.0, kl_coef=0.1, entropy_coef=0.01, **variant)
    mode = cfg.loss_agg_mode
    # The rejection mask is cut on the whole batch before the micro-batches, as the train
    # stage does; the variant must reject something for the test to cover it.
    mask = mask & behaviour_mask(old, behaviour, mask, cfg)
    if cfg.off_policy_mask != "none":
        assert 0 < int(mask.sum()) < int(_batch(seed=3)[-1].sum())
    counts = {
        "num_tokens_global": int(mask.sum()),
        "num_seqs_global": int((mask.sum(1) > 0).sum()),
        "token_sum_norm": NORM,
    }

    parts = [aggregate(logp[i : i + 2], mask[i : i + 2], mode, **counts) for i in (0, 2, 4)]
    whole = aggregate(logp, mask, mode, token_sum_norm=NORM)
    assert abs(whole.item() - sum(part.item() for part in parts)) < 1e-12

    def run(rows, **kwargs):
        logp_leaf = logp[rows].clone().requires_grad_()
        entropy_leaf = entropy[rows].clone().requires_grad_()
        loss, _ = total_loss(
            logp_leaf,
            old[rows],
            adv[rows],
            mask[rows],
            cfg,
            behaviour_logp_BT=behaviour[rows],
            ref_logp_BT=ref[rows],
            entropy_BT=entropy_leaf,
            **{"token_sum_norm": NORM, **kwargs},
        )
        loss.backward()
        return loss.item(), logp_leaf.grad, entropy_leaf.grad

    full_loss, full_grad, full_entropy_grad = run(slice(None))
    parts = [run(slice(i, i + 2), **counts) for i in (0, 2, 4)]
    assert abs(full_loss - sum(part[0] for part in parts)) < 1e-12
    torch.testing.assert_close(torch.cat([part[1] for part in parts]), full_grad)
    torch.testing.assert_close(torch.cat([part[2] for part in parts]), full_entropy_grad)


def test_gspo_is_the_sequence_level_objective():
    # Four sequences (lengths 3, 2, 4, 1; padding holds a wild log-prob) with mean log-ratios
    # chosen against GSPO's tiny clips [1 - 3e-4, 1 + 4e-4]: inside (A = +1), above (A = +1:
    # clipped), below (A = -1: clipped), above (A = -1: unclipped, the max).
    mean_log_ratio = [1e-4, 1e-2, -1e-2, 5e-3]
    adv = [1.0, 1.0, -1.0, -1.0]
    lengths = [3, 2, 4, 1]
    offsets = [[0.3, -0.1, -0.2], [0.05, -0.05], [0.1, 0.2, -0.1, -0.2], [0.0]]
    logp = torch.full((4, 4), 50.0, dtype=torch.float64)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for b in range(4):
        for t in range(lengths[b]):
            logp[b, t] = mean_log_ratio[b] + offsets[b][t]  # old_logp = 0
            mask[b, t] = True
    cfg = GRPOConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    leaf = logp.clone().requires_grad_()
    loss, metrics = policy_loss(
        leaf, torch.zeros_like(logp), torch.tensor(adv, dtype=torch.float64), mask, cfg
    )
    loss.backward()

    s = [math.exp(m) for m in mean_log_ratio]
    per_seq = [max(-a * r, -a * min(max(r, 1 - 3e-4), 1 + 4e-4)) for a, r in zip(adv, s)]
    assert abs(loss.item() - sum(per_seq) / 4) < 1e-12
    # d/dlogp_t of -A s_i / S is -A s_i / (n_i S) on an unclipped sequence, 0 on a clipped one
    unclipped = [True, False, False, True]
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for b in range(4):
        if unclipped[b]:
            expected[b, : lengths[b]] = -adv[b] * s[b] / (lengths[b] * 4)
    torch.testing.assert_close(leaf.grad, expected)
    assert abs(metrics["actor/clip_frac"].item() - 6 / 10) < 1e-7  # tokens of sequences 1, 2

    # The same objective written at the sequence level, differentiated by autograd.
    direct = logp.clone().requires_grad_()
    seq_log = (direct * mask).sum(-1) / mask.sum(-1)
    ratio = seq_log.exp()
    adv_t = torch.tensor(adv, dtype=torch.float64)
    ref = torch.maximum(-adv_t * ratio, -adv_t * ratio.clamp(1 - 3e-4, 1 + 4e-4)).mean()
    ref.backward()
    assert abs(ref.item() - loss.item()) < 1e-12
    torch.testing.assert_close(direct.grad, leaf.grad)
    # and it is not token-level PPO on the same data
    ppo, _ = policy_loss(
        logp,
        torch.zeros_like(logp),
        adv_t,
        mask,
        GRPOConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean"),
    )
    assert abs(ppo.item() - loss.item()) > 1e-4


def _clip_case(clip_ratio_c):
    # Sample 0 has A = +1 (3 real tokens and a padded one); sample 1 has A = -1.
    ratios = [[0.5, 1.1, 1.5, 1.0], [0.5, 1.1, 1.5, 4.0]]
    logp = torch.tensor(ratios, dtype=torch.float64).log()
    logp[0, 3] = 50.0  # padding: must not leak even though exp(50) is huge
    logp.requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    cfg = GRPOConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c)
    loss, metrics = policy_loss(
        logp, torch.zeros_like(logp), torch.tensor([1.0, -1.0], dtype=torch.float64), mask, cfg
    )
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_ppo_clip_branches_values_and_gradients():
    loss, grad, metrics = _clip_case(clip_ratio_c=None)
    # A = +1: max(-r, -clip(r, 0.8, 1.28)) -> -0.5, -1.1, -1.28 (clipped: no gradient).
    # A = -1: max(r, clip(r, 0.8, 1.28)) -> 0.8 (clipped), 1.1, 1.5, 4.0.
    expected = [-0.5, -1.1, -1.28, 0.8, 1.1, 1.5, 4.0]
    assert abs(loss - sum(expected) / 7) < 1e-12
    # d(-A r)/dlogp = -A r on the unclipped branch, 0 on the clipped one and on padding.
    torch.testing.assert_close(
        grad, torch.tensor([[-0.5, -1.1, 0.0, 0.0], [0.0, 1.1, 1.5, 4.0]], dtype=torch.float64) / 7
    )
    assert abs(metrics["actor/clip_frac"].item() - 2 / 7) < 1e-7
    assert metrics["actor/dual_clip_frac"].item() == 0.0
    ratios = [0.5, 1.1, 1.5, 0.5, 1.1, 1.5, 4.0]
    assert abs(metrics["actor/ratio_mean"].item() - sum(ratios) / 7) < 1e-12
    assert abs(metrics["actor/ratio_max"].item() - 4.0) < 1e-12
    ppo_kl = sum(-math.log(r) for r in ratios) / 7
    assert abs(metrics["actor/ppo_kl"].item() - ppo_kl) < 1e-12
    assert metrics["offpolicy/is_weight_mean"].item() == 1.0
    assert metrics["offpolicy/capped_frac"].item() == 0.0


def test_dual_clip_caps_negative_advantage_loss_at_c():
    loss, grad, metrics = _clip_case(clip_ratio_c=3.0)
    # The A = -1 token with r = 4: min(4.0, -A * c = 3.0) -> 3.0, constant, zero gradient.
    assert abs(loss - (-0.5 - 1.1 - 1.28 + 0.8 + 1.1 + 1.5 + 3.0) / 7) < 1e-12
    assert grad[1, 3].item() == 0.0 and grad[1, 2].item() == pytest.approx(1.5 / 7)
    assert abs(metrics["actor/dual_clip_frac"].item() - 1 / 7) < 1e-7


# rho = exp(old - behaviour) per token; tis_cap = 2. Sample 0 has rho [0.5, 1, 3] (prod 1.5),
# sample 1 has rho [1.5, 1, 1.8] (prod 2.7).
RHO = [[0.5, 1.0, 3.0], [1.5, 1.0, 1.8]]
WEIGHTS = {
    "none": ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 0),
    "tis_token": ([[0.5, 1.0, 2.0], [1.5, 1.0, 1.8]], 1),
    "tis_seq": ([[1.5, 1.5, 1.5], [2.0, 2.0, 2.0]], 3),
    "decoupled": ([[0.5, 1.0, 0.0], [1.5, 1.0, 1.8]], 1),
}


@pytest.mark.parametrize("mode", WEIGHTS)
def test_off_policy_weights_are_capped_and_detached(mode):
    weights, num_capped = WEIGHTS[mode]
    old = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    behaviour = (-torch.tensor(RHO, dtype=torch.float64).log()).requires_grad_()
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)  # r = 1: inside the clip
    adv = [2.0, -1.0]
    cfg = GRPOConfig(off_policy_correction=mode, tis_cap=2.0)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv_B = torch.tensor(adv, dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv_B, mask, cfg, behaviour)
    loss.backward()
    expected = sum(-adv[b] * weights[b][t] for b in range(2) for t in range(3)) / 6
    assert abs(loss.item() - expected) < 1e-12
    expected_grad = [[-adv[b] * weights[b][t] / 6 for t in range(3)] for b in range(2)]
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=torch.float64))
    assert old.grad is None and behaviour.grad is None  # the weight is data
    flat = [w for row in weights for w in row]
    assert abs(metrics["offpolicy/is_weight_mean"].item() - sum(flat) / 6) < 1e-12
    assert abs(metrics["offpolicy/is_weight_max"].item() - max(flat)) < 1e-12
    assert abs(metrics["offpolicy/capped_frac"].item() - num_capped / 6) < 1e-7
    gap = sum(math.log(r) for row in RHO for r in row) / 6
    assert abs(metrics["offpolicy/logp_gap_mean"].item() - gap) < 1e-12


def test_off_policy_correction_needs_behaviour_logp():
    cfg = GRPOConfig(off_policy_correction="decoupled")
    with pytest.raises(ValueError, match="off_policy_correction='decoupled' needs behaviour_logp"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), cfg)


def test_total_loss_by_hand():
    cfg = GRPOConfig(
        loss_agg_mode="seq-mean-token-sum", kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01
    )
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0], [-0.1, 0.0]])
    entropy = torch.tensor([[2.0, 1.0], [0.5, 99.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -3.0])
    loss, metrics = total_loss(
        logp, logp.detach(), adv, mask, cfg, ref_logp_BT=ref, entropy_BT=entropy
    )
    loss.backward()
    pg = ((-1.0 - 1.0) + 3.0) / 2  # r = 1: pg = -A; sum per sequence, mean over 2 sequences
    kl = (0.5 * 0.5**2 + 0.0 + 0.5 * 0.4**2) / 2
    ent = ((2.0 + 1.0) + 0.5) / 2
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent, abs=1e-6)
    assert metrics["actor/pg_loss"].item() == pytest.approx(pg)
    assert metrics["kl/mean"].item() == pytest.approx((0.125 + 0.08) / 3)
    assert metrics["entropy/mean"].item() == pytest.approx(3.5 / 3)
    assert metrics["actor/loss"].item() == pytest.approx(loss.item())
    # dpg/dlogp = -A / 2; dk2/dlogp = (logp - ref); entropy gradient -0.01 / 2 on real tokens.
    expected = [[-0.5 + 0.1 * 0.5 / 2, -0.5], [1.5 + 0.1 * -0.4 / 2, 0.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected))
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.005, -0.005], [-0.005, 0.0]]))


def test_kl_reward_mode_keeps_kl_out_of_the_loss():
    cfg = GRPOConfig(kl_coef=0.5, kl_mode="reward")
    logp, old, ref = torch.zeros(1, 2), torch.zeros(1, 2), torch.full((1, 2), -1.0)
    loss, metrics = total_loss(logp, old, torch.ones(1), torch.ones(1, 2), cfg, ref_logp_BT=ref)
    assert loss.item() == -1.0 and "actor/kl_loss" not in metrics
    assert metrics["kl/mean"].item() == pytest.approx(math.exp(-1.0) + 1.0 - 1.0)


def test_total_loss_needs_ref_and_entropy_when_their_terms_are_on():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="kl_coef > 0 with kl_mode='loss' needs ref_logp_BT"):
        total_loss(*args, GRPOConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropy_BT"):
        total_loss(*args, GRPOConfig(entropy_coef=0.1))
