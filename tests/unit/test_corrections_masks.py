"""Off-policy rejection masks and the engine-vs-trainer mismatch metrics, against formulas
written here with plain loops and `math`.

Contract: `behaviour_mask` rejects, with rho_t = exp(old_logp_t - behaviour_logp_t) over a
sequence's real tokens, the tokens whose rho_t is outside [low, high] (token), the sequences
whose prod_t rho_t is (seq) or whose exp(mean_t log rho_t) is (geo_mean), and nothing for none;
padding never decides anything. `rejection_metrics` is the share of real tokens rejected and of
sequences that lose every token. `mismatch_metrics` is, with d = engine_logp - train_logp on
the masked tokens, mean d (k1), mean exp(-d) - 1 + d (k3) and max |d|. Nothing is faked.
"""

import math

import pytest
import torch

from megatron_async_rl.algorithms.config import GRPOConfig
from megatron_async_rl.algorithms.corrections import (
    behaviour_mask,
    mismatch_metrics,
    rejection_metrics,
)

# rho per real token; sequence lengths 3, 2, 4, 0 (padded to 4)
RHO = [[0.4, 1.0, 1.5], [2.5, 1.1], [1.2, 1.3, 1.25, 1.4], []]
LOW, HIGH = 0.5, 2.0


def _tensors():
    old = torch.zeros(4, 4, dtype=torch.float64)
    behaviour = torch.full((4, 4), 7.0, dtype=torch.float64)  # padding: a wild ratio
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for b, row in enumerate(RHO):
        for t, rho in enumerate(row):
            behaviour[b, t] = -math.log(rho)
            mask[b, t] = True
    return old, behaviour, mask


def _expected(mode):
    keep = []
    for row in RHO:
        if mode == "token":
            keep.append([LOW <= rho <= HIGH for rho in row])
            continue
        if not row:
            keep.append([])
            continue
        if mode == "seq":
            stat = math.prod(row)
        else:
            stat = math.exp(sum(math.log(rho) for rho in row) / len(row))
        keep.append([LOW <= stat <= HIGH] * len(row))
    return keep


@pytest.mark.parametrize("mode", ["token", "seq", "geo_mean"])
def test_rejection_masks_by_hand(mode):
    old, behaviour, mask = _tensors()
    cfg = GRPOConfig(off_policy_mask=mode, off_policy_mask_low=LOW, off_policy_mask_high=HIGH)
    keep = behaviour_mask(old, behaviour, mask, cfg)
    expected = _expected(mode)
    assert [keep[b, : len(row)].tolist() for b, row in enumerate(RHO)] == expected
    # Sequence 2's product (2.73) is out of band, its geometric mean (1.29) in: seq and
    # geo_mean must disagree there, and token must keep all four of its tokens.
    assert expected[2] == {"token": [True] * 4, "seq": [False] * 4, "geo_mean": [True] * 4}[mode]
    metrics = rejection_metrics(mask, keep)
    flat = [k for row in expected for k in row]
    assert metrics["offpolicy/masked_token_frac"] == pytest.approx(flat.count(False) / len(flat))
    lost = sum(1 for row in expected if row and not any(row))
    assert metrics["offpolicy/masked_seq_frac"] == pytest.approx(lost / 3)


def test_none_rejects_nothing_and_low_zero_accepts_any_small_ratio():
    old, behaviour, mask = _tensors()
    assert bool(behaviour_mask(old, behaviour, mask, GRPOConfig()).all())
    cfg = GRPOConfig(off_policy_mask="token", off_policy_mask_low=0.0, off_policy_mask_high=2.0)
    keep = behaviour_mask(old, behaviour, mask, cfg)
    assert keep[0, 0].item() and not keep[1, 0].item()  # rho 0.4 kept, rho 2.5 rejected
    behaviour[0, 0] = 80.0  # rho = exp(-80): still inside [0, 2]
    assert behaviour_mask(old, behaviour, mask, cfg)[0, 0].item()


def test_band_edges_are_inclusive():
    old = torch.zeros(1, 2, dtype=torch.float64)
    behaviour = -torch.tensor([[0.5, 2.0]], dtype=torch.float64).log()
    cfg = GRPOConfig(off_policy_mask="token", off_policy_mask_low=0.5, off_policy_mask_high=2.0)
    assert behaviour_mask(old, behaviour, torch.ones(1, 2), cfg).tolist() == [[True, True]]


def test_mismatch_metrics_by_hand():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 5.0, 5.0]])
    engine = torch.tensor([[-1.2, -1.5, -0.5], [-0.9, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    d = [-1.2 + 1.0, -1.5 + 2.0, 0.0, -0.9 + 0.3]
    out = mismatch_metrics(train, engine, mask, "/trained")
    assert set(out) == {"mismatch/k1/trained", "mismatch/k3_kl/trained", "mismatch/max_abs/trained"}
    assert out["mismatch/k1/trained"] == pytest.approx(sum(d) / 4)
    k3 = [math.exp(-x) - 1 + x for x in d]
    assert out["mismatch/k3_kl/trained"] == pytest.approx(sum(k3) / 4)
    assert out["mismatch/max_abs/trained"] == pytest.approx(max(abs(x) for x in d))
    assert min(k3) >= 0.0
    empty = mismatch_metrics(train, engine, torch.zeros(2, 3))
    assert empty == {"mismatch/k1": 0.0, "mismatch/k3_kl": 0.0, "mismatch/max_abs": 0.0}
