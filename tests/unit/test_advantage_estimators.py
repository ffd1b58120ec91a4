"""Advantage estimators and DAPO's overlong reward shaping, against formulas written here.

Contract: `compute_advantages` gives, per `advantage_estimator`, grpo's (r - mean_g) / (std_g +
eps), dr_grpo's r - mean_g, rloo's r_i - mean of the group's other rewards, reinforce_pp's
batch-whitened rewards and reinforce_pp_baseline's batch-whitened r - mean_g, the whitening's
mean and unbiased std taken over the trained tokens (each sample counted once per token of the
loss mask; a masked-out sample not at all); `overlong_penalty` is 0 up to L_max - L_buf, then
falls linearly to -factor at L_max and stays there. The reference values are computed with plain
loops and `statistics`, independently of the implementation. Nothing is faked.
"""

import statistics

import pytest
import torch

from megatron_async_rl.algorithms.advantages import (
    compute_advantages,
    overlong_penalty,
    rloo_advantages,
    whiten,
)
from megatron_async_rl.algorithms.config import GRPOConfig

REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 3.0, 0.0, 0.25]  # three groups of three
LENGTHS = [4, 2, 0, 1, 3, 5, 2, 2, 6]  # trained tokens per sample; sample 2 is masked out
EPS = 1e-6


def _mask(lengths):
    return (torch.arange(8).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def _groups(values, size=3):
    return [values[i : i + size] for i in range(0, len(values), size)]


def _centred(values, size=3):
    return [v - statistics.fmean(g) for g in _groups(values, size) for v in g]


def _whitened(values, lengths, eps=EPS):
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mu, sd = statistics.fmean(tokens), statistics.stdev(tokens)
    return [(v - mu) / (sd + eps) for v in values]


def _rloo(values, size=3):
    out = []
    for g in _groups(values, size):
        out += [g[i] - statistics.fmean(g[:i] + g[i + 1 :]) for i in range(len(g))]
    return out


def _grpo(values, size=3, eps=EPS):
    return [
        (v - statistics.fmean(g)) / (statistics.stdev(g) + eps)
        for g in _groups(values, size)
        for v in g
    ]


EXPECTED = {
    "grpo": _grpo(REWARDS),
    "dr_grpo": _centred(REWARDS),
    "rloo": _rloo(REWARDS),
    "reinforce_pp": _whitened(REWARDS, LENGTHS),
    "reinforce_pp_baseline": _whitened(_centred(REWARDS), LENGTHS),
}


@pytest.mark.parametrize("estimator", EXPECTED)
def test_each_estimator_matches_its_formula(estimator):
    cfg = GRPOConfig(num_samples_per_prompt=3, advantage_estimator=estimator, advantage_eps=EPS)
    adv = compute_advantages(torch.tensor(REWARDS), _mask(LENGTHS), 3, cfg)
    torch.testing.assert_close(adv, torch.tensor(EXPECTED[estimator]), rtol=1e-5, atol=1e-6)


def test_estimators_differ_on_this_batch():
    # The reference batch tells the estimators apart: no two formulas coincide on it.
    values = [tuple(round(v, 6) for v in vs) for vs in EXPECTED.values()]
    assert len(set(values)) == len(values)


def test_grpo_without_std_is_dr_grpo_advantage():
    cfg = GRPOConfig(num_samples_per_prompt=3, normalize_advantage_by_std=False)
    adv = compute_advantages(torch.tensor(REWARDS), _mask(LENGTHS), 3, cfg)
    torch.testing.assert_close(adv, torch.tensor(_centred(REWARDS)))


def test_whitening_counts_trained_tokens_only():
    # A masked-out sample's reward does not move the batch statistics.
    cfg = GRPOConfig(num_samples_per_prompt=3, advantage_estimator="reinforce_pp")
    changed = list(REWARDS)
    changed[2] = 100.0  # sample 2 has no trained token
    adv = compute_advantages(torch.tensor(REWARDS), _mask(LENGTHS), 3, cfg)
    adv_changed = compute_advantages(torch.tensor(changed), _mask(LENGTHS), 3, cfg)
    keep = [i for i, n in enumerate(LENGTHS) if n]
    torch.testing.assert_close(adv[keep], adv_changed[keep])


def test_rloo_group_of_one_and_group_ids():
    rewards = torch.tensor([3.0, 1.0, 0.0, 2.0, 5.0])
    group_ids = torch.tensor([7, 2, 7, 2, 9])  # groups {0, 2}, {1, 3}, {4}
    # pairs: r_i - r_other; the group of one gets 0
    expected = [3.0 - 0.0, 1.0 - 2.0, 0.0 - 3.0, 2.0 - 1.0, 0.0]
    torch.testing.assert_close(rloo_advantages(rewards, group_ids), torch.tensor(expected))


def test_whiten_degenerate_batches():
    # One token in all: no spread, sigma = 0, (v - mu) / eps = 0 for that sample.
    out = whiten(torch.tensor([2.0, 5.0]), torch.tensor([1, 0]), eps=1e-6)
    assert out[0].item() == 0.0
    # All equal with eps = 0: a zero denominator gives 0, not NaN.
    out = whiten(torch.tensor([1.0, 1.0]), torch.tensor([2, 3]), eps=0.0)
    assert out.tolist() == [0.0, 0.0]


def test_reinforce_pp_checks_the_batch_like_the_group_estimators():
    cfg = GRPOConfig(num_samples_per_prompt=2, advantage_estimator="reinforce_pp")
    with pytest.raises(ValueError, match="5 samples do not split into groups of 2"):
        compute_advantages(torch.zeros(5), torch.ones(5, 3), 2, cfg)


def _dapo_penalty(length, max_len, buffer_len, factor):
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    if length <= max_len:
        return -(length - start) / buffer_len * factor
    return -factor


@pytest.mark.parametrize("max_len, buffer_len, factor", [(16, 4, 1.0), (20, 20, 0.5), (8, 1, 2.0)])
def test_overlong_penalty_matches_dapo(max_len, buffer_len, factor):
    lengths = list(range(0, max_len + 4))
    out = overlong_penalty(torch.tensor(lengths, dtype=torch.float32), max_len, buffer_len, factor)
    expected = [_dapo_penalty(n, max_len, buffer_len, factor) for n in lengths]
    torch.testing.assert_close(out, torch.tensor(expected))
    assert out.min().item() == -factor  # the limit itself (and beyond) loses the whole factor


def test_overlong_penalty_off_is_zero():
    out = overlong_penalty(torch.tensor([1.0, 16.0, 40.0]), 16, 0, 1.0)
    assert out.tolist() == [0.0, 0.0, 0.0]
