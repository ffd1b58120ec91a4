"""PPO-with-a-critic math (`algorithms.ppo`) against formulas written out here in plain Python.

Contract: `token_rewards` puts each sequence reward on the sample's last trained token, adds
per-turn rewards on their columns (refusing a column that is not trained) and subtracts
kl_coef * KL on trained tokens; `gae` is Generalized Advantage Estimation over each sample's
model-token subsequence (environment tokens and padding skipped, terminal value 0), with
gamma = lam = 1 the reward-to-go minus the value, and returns = advantages + values; `whiten`
is (x - mean) / sqrt(unbiased var + eps) over the trained tokens; `value_loss` is
0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), picks the right branch (zero gradient on the
clipped one), and its micro-batch losses with global counts sum to the full-batch loss in every
aggregation mode; `explained_variance` is 1 - Var(R - V) / Var(R), 1 for perfect values.
References are loops over lists, written independently of the tensor code. Nothing is faked.
"""

import math

import pytest
import torch

from megatron_async_rl.algorithms.ppo import (
    WHITEN_EPS,
    explained_variance,
    gae,
    token_rewards,
    value_loss,
    whiten,
)

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
NORM = 8  # seq-mean-token-sum-norm's constant L
NAN = float("nan")

# Right-padded, with a multi-turn row (environment tokens at columns 3-4) and an empty row.
MASK = [
    [1, 1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 0, 0, 1, 1, 0],
    [1, 1, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0, 0, 0],
]


def _random(rows: int, cols: int, seed: int) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).tolist()


def _with_nan_off_mask(x: list[list[float]], mask: list[list[int]]) -> torch.Tensor:
    """Untrained positions hold NaN: the code must never read them."""
    return torch.tensor([[v if m else NAN for v, m in zip(r, mr)] for r, mr in zip(x, mask)])


def _assert_grid(actual: torch.Tensor, expected: list[list[float]], tol: float = 1e-5) -> None:
    assert actual.shape == (len(expected), len(expected[0]))
    for got_row, want_row in zip(actual.tolist(), expected):
        for got, want in zip(got_row, want_row):
            assert got == pytest.approx(want, abs=tol)


def ref_gae(rewards, values, mask, gamma, lam):
    """A_k = sum_{j >= k} (gamma lam)^(j - k) delta_j over each row's model-token subsequence,
    delta_j = r_j + gamma V_{j+1} - V_j and V after the last model token 0."""
    adv = [[0.0] * len(row) for row in mask]
    ret = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, m in enumerate(row) if m]
        deltas = []
        for k, t in enumerate(idx):
            v_next = values[i][idx[k + 1]] if k + 1 < len(idx) else 0.0
            deltas.append(rewards[i][t] + gamma * v_next - values[i][t])
        for k, t in enumerate(idx):
            adv[i][t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(idx)))
            ret[i][t] = adv[i][t] + values[i][t]
    return adv, ret


# --- token_rewards ------------------------------------------------------------------------


def test_terminal_reward_on_last_trained_token():
    rewards = token_rewards(torch.tensor([1.0, -0.5, 2.0, 3.0, 7.0]), torch.tensor(MASK))
    expected = [[0.0] * 8 for _ in MASK]
    expected[0][5], expected[1][6], expected[2][1], expected[3][7] = 1.0, -0.5, 2.0, 3.0
    _assert_grid(rewards, expected)  # the empty row gets nothing
    assert rewards.dtype == torch.float32


def test_turn_rewards_add_on_their_columns():
    turns = [[(2, 0.25), (5, 0.5)], [(2, 1.0), (6, 2.0), (6, 0.5)], [], [], []]
    rewards = token_rewards(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]), torch.tensor(MASK), turns)
    expected = [[0.0] * 8 for _ in MASK]
    expected[0][2], expected[0][5] = 0.25, 1.0 + 0.5
    expected[1][2], expected[1][6] = 1.0, 2.5
    _assert_grid(rewards, expected)


def test_kl_penalty_on_trained_tokens():
    kl = _random(5, 8, seed=1)
    rewards = token_rewards(
        torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]),
        torch.tensor(MASK),
        kl_BT=_with_nan_off_mask(kl, MASK),
        kl_coef=0.1,
    )
    expected = [[-0.1 * k if m else 0.0 for k, m in zip(kr, mr)] for kr, mr in zip(kl, MASK)]
    expected[0][5] += 1.0
    _assert_grid(rewards, expected)


@pytest.mark.parametrize(
    "turns, match",
    [
        # padding, an environment token, past the grid, negative, the wrong number of lists
        ([[(6, 1.0)], [], [], [], []], r"sample 0 at column 6: must be a trained column"),
        ([[], [(3, 1.0)], [], [], []], r"sample 1 at column 3: must be a trained column"),
        ([[], [], [], [(8, 1.0)], []], r"sample 3 at column 8: .* in \[0, 8\)"),
        ([[], [], [], [(-1, 1.0)], []], r"sample 3 at column -1"),
        ([[], []], r"turn_rewards has 2 lists; expected 5"),
    ],
)
def test_turn_reward_errors(turns, match):
    with pytest.raises(ValueError, match=match):
        token_rewards(torch.zeros(5), torch.tensor(MASK), turns)


def test_seq_rewards_shape_error():
    with pytest.raises(ValueError, match=r"seq_rewards_B has shape \(4,\); expected \(5,\)"):
        token_rewards(torch.zeros(4), torch.tensor(MASK))


# --- gae ----------------------------------------------------------------------------------


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards, values = _random(5, 8, seed=2), _random(5, 8, seed=3)
    adv, ret = gae(
        _with_nan_off_mask(rewards, MASK), _with_nan_off_mask(values, MASK),
        torch.tensor(MASK), gamma=1.0, lam=1.0,
    )  # fmt: skip
    expected_adv = [[0.0] * 8 for _ in MASK]
    expected_ret = [[0.0] * 8 for _ in MASK]
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if m:
                to_go = sum(rewards[i][j] for j in range(t, 8) if row[j])
                expected_adv[i][t] = to_go - values[i][t]
                expected_ret[i][t] = to_go
    _assert_grid(adv, expected_adv)
    _assert_grid(ret, expected_ret)


@pytest.mark.parametrize("gamma, lam", [(0.9, 0.7), (0.99, 0.95), (0.5, 1.0), (1.0, 0.0)])
def test_gae_discounted_on_padded_batch(gamma, lam):
    rewards, values = _random(5, 8, seed=4), _random(5, 8, seed=5)
    adv, ret = gae(
        _with_nan_off_mask(rewards, MASK), _with_nan_off_mask(values, MASK),
        torch.tensor(MASK).bool(), gamma, lam,
    )  # fmt: skip
    expected_adv, expected_ret = ref_gae(rewards, values, MASK, gamma, lam)
    _assert_grid(adv, expected_adv)
    _assert_grid(ret, expected_ret)


def test_gae_lam_zero_is_one_step_td():
    rewards, values = _random(1, 4, seed=6)[0], _random(1, 4, seed=7)[0]
    adv, _ = gae(torch.tensor([rewards]), torch.tensor([values]), torch.ones(1, 4), 0.9, 0.0)
    td = [rewards[t] + 0.9 * (values[t + 1] if t < 3 else 0.0) - values[t] for t in range(4)]
    _assert_grid(adv, [td])


def test_gae_skips_environment_tokens():
    """Environment tokens (mask 0 inside the response) hold large junk rewards and values: the
    recursion must link each model token to the next model token, as on the subsequence."""
    mask = [[1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
    rewards, values = _random(2, 12, seed=8), _random(2, 12, seed=9)
    junk = [[v if m else 100.0 for v, m in zip(r, mr)] for r, mr in zip(rewards, mask)]
    junk_values = [[v if m else -50.0 for v, m in zip(r, mr)] for r, mr in zip(values, mask)]
    gamma, lam = 0.95, 0.9
    adv, ret = gae(torch.tensor(junk), torch.tensor(junk_values), torch.tensor(mask), gamma, lam)
    for i, row in enumerate(mask):
        idx = [t for t, m in enumerate(row) if m]
        sub_adv, sub_ret = ref_gae(
            [[rewards[i][t] for t in idx]], [[values[i][t] for t in idx]], [[1] * len(idx)],
            gamma, lam,
        )  # fmt: skip
        assert [adv[i, t].item() for t in idx] == pytest.approx(sub_adv[0], abs=1e-5)
        assert [ret[i, t].item() for t in idx] == pytest.approx(sub_ret[0], abs=1e-5)
        assert all(adv[i, t].item() == 0.0 for t in range(12) if not row[t])
    # A recursion that stepped through the environment tokens (as zero-reward, zero-value steps)
    # gives other advantages: the comparison above can fail.
    stepped = [[v if m else 0.0 for v, m in zip(r, mr)] for r, mr in zip(values, mask)]
    zero_r = [[v if m else 0.0 for v, m in zip(r, mr)] for r, mr in zip(rewards, mask)]
    naive_adv, _ = ref_gae(zero_r, stepped, [[1] * 12, [1] * 12], gamma, lam)
    assert adv[0, 0].item() != pytest.approx(naive_adv[0][0], abs=1e-3)


def test_gae_zero_values_give_sequence_reward_everywhere():
    """A zero-initialised value head with gamma = lam = 1: every trained token's advantage is
    its sequence's reward (terminal reward through `token_rewards`)."""
    mask = torch.tensor(MASK)
    adv, ret = gae(token_rewards(torch.tensor([1.0, -2.0, 0.5, 3.0, 9.0]), mask),
                   torch.zeros(5, 8), mask, 1.0, 1.0)  # fmt: skip
    expected = [[r * m for m in row] for r, row in zip([1.0, -2.0, 0.5, 3.0, 9.0], MASK)]
    _assert_grid(adv, expected)
    _assert_grid(ret, expected)


def test_gae_shape_error():
    with pytest.raises(ValueError, match="must have one shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


# --- whiten -------------------------------------------------------------------------------


def _ref_stats(x, mask):
    vals = [v for r, mr in zip(x, mask) for v, m in zip(r, mr) if m]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, var


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_by_hand(shift_mean):
    x = [[3.0 * v + 2.0 for v in row] for row in _random(5, 8, seed=10)]
    out = whiten(_with_nan_off_mask(x, MASK), torch.tensor(MASK), shift_mean=shift_mean)
    mean, var = _ref_stats(x, MASK)
    expected = [
        [((v - mean) / math.sqrt(var + WHITEN_EPS) + (0 if shift_mean else mean)) * m
         for v, m in zip(r, mr)]
        for r, mr in zip(x, MASK)
    ]  # fmt: skip
    _assert_grid(out, expected)
    out_mean, out_var = _ref_stats(out.tolist(), MASK)
    assert out_mean == pytest.approx(0.0 if shift_mean else mean, abs=1e-5)
    assert out_var == pytest.approx(1.0, abs=1e-4)


def test_whiten_one_token_is_zero():
    out = whiten(torch.tensor([[5.0, NAN]]), torch.tensor([[1, 0]]))
    assert out.tolist() == [[0.0, 0.0]]


# --- value_loss ---------------------------------------------------------------------------


def _ref_token_loss(v, v_old, r, clip):
    if clip is None:
        return 0.5 * (v - r) ** 2, False
    v_clipped = min(max(v, v_old - clip), v_old + clip)
    plain, clipped = (v - r) ** 2, (v_clipped - r) ** 2
    return 0.5 * max(plain, clipped), clipped > plain


def test_value_clipping_branch_selection():
    # V_old = 0, R = 1, c = 0.2: inside the band; past it towards R (clipped, larger error);
    # past it away from R (unclipped error larger); overshooting R (clipped); padding.
    values = torch.tensor([[0.1, 0.5, -0.5, 1.5, 9.0]], requires_grad=True)
    old, ret = torch.tensor([[0.0, 0, 0, 0, NAN]]), torch.tensor([[1.0, 1.0, 1.0, 1.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, ret, mask, 0.2, "token-mean")
    refs = [_ref_token_loss(v, 0.0, 1.0, 0.2) for v in [0.1, 0.5, -0.5, 1.5]]
    assert [c for _, c in refs] == [False, True, False, True]
    assert loss.item() == pytest.approx(sum(lo for lo, _ in refs) / 4)
    assert metrics["critic/clip_frac"].item() == 0.5
    loss.backward()
    # d/dV of 0.5 (V - R)^2 / 4 where unclipped; 0 where the clamp is active and on padding
    # (whose NaN data must not reach the gradient).
    assert values.grad.tolist()[0] == pytest.approx([(0.1 - 1) / 4, 0.0, (-0.5 - 1) / 4, 0.0, 0])


def test_value_loss_unclipped_and_metrics():
    values, old, ret = _random(5, 8, seed=11), _random(5, 8, seed=12), _random(5, 8, seed=13)
    loss, metrics = value_loss(
        _with_nan_off_mask(values, MASK), _with_nan_off_mask(old, MASK),
        _with_nan_off_mask(ret, MASK), torch.tensor(MASK), None, "token-mean",
    )  # fmt: skip
    cells = [(i, t) for i, row in enumerate(MASK) for t, m in enumerate(row) if m]
    n = len(cells)
    assert loss.item() == pytest.approx(
        sum(0.5 * (values[i][t] - ret[i][t]) ** 2 for i, t in cells) / n, rel=1e-5
    )
    assert metrics["critic/value_loss"].item() == pytest.approx(loss.item())
    assert metrics["critic/clip_frac"].item() == 0.0
    assert metrics["critic/values_mean"].item() == pytest.approx(
        sum(values[i][t] for i, t in cells) / n, abs=1e-6
    )
    assert metrics["critic/returns_mean"].item() == pytest.approx(
        sum(ret[i][t] for i, t in cells) / n, abs=1e-6
    )


def _ref_aggregate(token_loss, mask, mode):
    seqs = [[lo for lo, m in zip(r, mr) if m] for r, mr in zip(token_loss, mask)]
    seqs = [s for s in seqs if s]
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    return sum(sum(s) for s in seqs) / (len(seqs) * NORM)


@pytest.mark.parametrize("clip", [0.1, None])
@pytest.mark.parametrize("mode", MODES)
def test_value_loss_micro_batches_sum_to_full_batch(mode, clip):
    values, old, ret = _random(5, 8, seed=14), _random(5, 8, seed=15), _random(5, 8, seed=16)
    mask = torch.tensor(MASK)
    counts = {
        "num_tokens_global": int(mask.sum()),
        "num_seqs_global": int((mask.sum(-1) > 0).sum()),
        "token_sum_norm": NORM,
    }

    def run(rows: slice, global_counts: bool):
        v = torch.tensor(values)[rows].clone().requires_grad_(True)
        loss, _ = value_loss(
            v, _with_nan_off_mask(old, MASK)[rows], _with_nan_off_mask(ret, MASK)[rows],
            mask[rows], clip, mode, **(counts if global_counts else {"token_sum_norm": NORM}),
        )  # fmt: skip
        loss.backward()
        return loss, v.grad

    full, full_grad = run(slice(0, 5), global_counts=False)
    token_loss = [
        [_ref_token_loss(v, o, r, clip)[0] for v, o, r in zip(vr, orow, rr)]
        for vr, orow, rr in zip(values, old, ret)
    ]
    assert full.item() == pytest.approx(_ref_aggregate(token_loss, MASK, mode), rel=1e-5)
    parts = [run(rows, global_counts=True) for rows in (slice(0, 2), slice(2, 3), slice(3, 5))]
    assert sum(loss.item() for loss, _ in parts) == pytest.approx(full.item(), rel=1e-5)
    micro_grad = torch.cat([grad for _, grad in parts])
    assert torch.allclose(micro_grad, full_grad, atol=1e-6)
    assert (full_grad[~mask.bool()] == 0).all()  # padding (NaN data) gets a zero gradient


def test_value_loss_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                   0.2, "mean")  # fmt: skip


# --- explained_variance -------------------------------------------------------------------


def test_explained_variance_perfect_and_offset_values():
    ret = _with_nan_off_mask(_random(5, 8, seed=17), MASK)
    assert explained_variance(ret, ret, torch.tensor(MASK)).item() == 1.0
    shifted = explained_variance(ret + 3.0, ret, torch.tensor(MASK)).item()
    assert shifted == pytest.approx(1.0, abs=1e-6)  # a constant offset explains all variance


def test_explained_variance_by_hand():
    values, ret = _random(5, 8, seed=18), _random(5, 8, seed=19)
    got = explained_variance(
        _with_nan_off_mask(values, MASK), _with_nan_off_mask(ret, MASK), torch.tensor(MASK)
    ).item()
    residual = [[r - v for r, v in zip(rr, vr)] for rr, vr in zip(ret, values)]
    expected = 1 - _ref_stats(residual, MASK)[1] / _ref_stats(ret, MASK)[1]
    assert got == pytest.approx(expected, rel=1e-5)
    zero = explained_variance(torch.zeros(5, 8), torch.tensor(ret), torch.tensor(MASK)).item()
    assert zero == pytest.approx(0.0, abs=1e-6)  # V = 0: Var(R - V) = Var(R), nothing explained


def test_explained_variance_undefined_is_nan():
    constant = torch.full((2, 3), 2.0)
    assert math.isnan(explained_variance(torch.zeros(2, 3), constant, torch.ones(2, 3)).item())
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert math.isnan(explained_variance(torch.zeros(2, 3), constant, one).item())
