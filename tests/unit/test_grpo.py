"""GRPOConfig validation and the per-batch GRPO math, against formulas written out here.

Contract: `GRPOConfig` rejects each bad value with a ConfigError naming key, value and rule,
resolves `loss_agg_mode` None to the mode of its policy loss and estimator (gspo:
seq-mean-token-mean, dr_grpo: seq-mean-token-sum-norm, else token-mean) and refuses a mode or a
combination that contradicts them; `check_overlong_budget` refuses a buffer past L_max;
`group_advantages` is (r - group mean) / (unbiased group std + eps), or r - mean, and 0 for a
group of one; `dynamic_filter` keeps exactly the groups whose rewards differ; `kl_penalty`'s
k1/k2/k3 match the closed forms (k3 clamped like verl's low_var_kl); `kl_reward` subtracts
coef * sum of the real tokens' KL. Reference numbers are computed by hand with `math`. Nothing
is faked.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.algorithms.config import check_overlong_budget, response_budget
from megatron_async_rl.algorithms.grpo import (
    GRPOConfig,
    dynamic_filter,
    group_advantages,
    kl_penalty,
    kl_reward,
)
from megatron_async_rl.config.errors import ConfigError


def test_defaults_are_valid_and_low_var_kl_is_k3():
    cfg = GRPOConfig()
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.loss_agg_mode) == (0.2, 0.2, "token-mean")
    assert GRPOConfig(kl_estimator="low_var_kl").kl_estimator == "k3"
    assert GRPOConfig(clip_ratio_high=0.28, clip_ratio_c=3.0).clip_ratio_c == 3.0


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"num_samples_per_prompt": 0}, r"num_samples_per_prompt = 0: must be an integer >= 1"),
        ({"num_samples_per_prompt": 2.0}, r"num_samples_per_prompt = 2.0: must be an integer >= 1"),
        (
            {"normalize_advantage_by_std": "yes"},
            r"normalize_advantage_by_std = 'yes': must be true or",
        ),
        ({"advantage_eps": 0.0}, r"advantage_eps = 0.0: must be a finite number > 0"),
        (
            {"clip_ratio_low": 1.0},
            r"clip_ratio_low = 1.0: must be a finite number in \[0, 1\); hint: ",
        ),
        ({"clip_ratio_low": -0.1}, r"clip_ratio_low = -0.1: must be a finite number in \[0, 1\)"),
        ({"clip_ratio_high": -0.2}, r"clip_ratio_high = -0.2: must be a finite number >= 0"),
        ({"clip_ratio_high": True}, r"clip_ratio_high = True: must be a finite number >= 0"),
        ({"clip_ratio_high": math.nan}, r"clip_ratio_high = nan: must be a finite number >= 0"),
        (
            {"clip_ratio_c": 1.0},
            r"clip_ratio_c = 1.0: must be a finite number > 1 or null; hint: dual-clip",
        ),
        ({"loss_agg_mode": "seq-mean"}, r"loss_agg_mode = 'seq-mean': must be one of token-mean"),
        ({"kl_coef": -0.1}, r"kl_coef = -0.1: must be a finite number >= 0"),
        ({"kl_estimator": "k4"}, r"kl_estimator = 'k4': must be one of k1, k2, k3, low_var_kl"),
        ({"kl_mode": "both"}, r"kl_mode = 'both': must be one of loss, reward"),
        ({"entropy_coef": -1}, r"entropy_coef = -1: must be a finite number >= 0"),
        ({"dynamic_filtering": 1}, r"dynamic_filtering = 1: must be true or false"),
        (
            {"dynamic_filtering": True, "num_samples_per_prompt": 1},
            r"dynamic_filtering = True: needs num_samples_per_prompt >= 2",
        ),
        ({"off_policy_correction": "tis"}, r"off_policy_correction = 'tis': must be one of none"),
        ({"tis_cap": 0.5}, r"tis_cap = 0.5: must be a finite number >= 1"),
        ({"policy_loss": "grpo"}, r"policy_loss = 'grpo': must be one of ppo, gspo"),
        (
            {"advantage_estimator": "ppo"},
            r"advantage_estimator = 'ppo': must be one of grpo, dr_grpo, rloo, reinforce_pp, "
            r"reinforce_pp_baseline",
        ),
        (
            {"off_policy_mask": "sequence"},
            r"off_policy_mask = 'sequence': must be one of none, token, seq, geo_mean",
        ),
        (
            {"off_policy_mask_low": 1.2},
            r"off_policy_mask_low = 1.2: must be a finite number in \[0, 1\]; hint: rho = 1",
        ),
        ({"off_policy_mask_low": -0.1}, r"off_policy_mask_low = -0.1: must be a finite number in"),
        (
            {"off_policy_mask_high": 0.9},
            r"off_policy_mask_high = 0.9: must be a finite number >= 1; hint: rho = 1",
        ),
        ({"off_policy_mask_high": math.inf}, r"off_policy_mask_high = inf: must be a finite"),
        ({"overlong_buffer_len": -1}, r"overlong_buffer_len = -1: must be an integer >= 0"),
        ({"overlong_buffer_len": 4.5}, r"overlong_buffer_len = 4.5: must be an integer >= 0"),
        (
            {"overlong_penalty_factor": -1.0},
            r"overlong_penalty_factor = -1.0: must be a finite number >= 0",
        ),
        ({"mask_truncated": "no"}, r"mask_truncated = 'no': must be true or false"),
        (
            {"loss_agg_mode": "seq-sum"},
            r"loss_agg_mode = 'seq-sum': must be one of .*seq-mean-token-sum-norm; hint: or null",
        ),
    ],
)
def test_config_rejects_bad_values(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        GRPOConfig(**overrides)
    key = next(iter(overrides)) if len(overrides) == 1 else "dynamic_filtering"
    assert info.value.key == key


def test_loss_agg_mode_defaults_to_the_policy_loss_and_estimator_own():
    assert GRPOConfig().loss_agg_mode == "token-mean"
    assert GRPOConfig(advantage_estimator="rloo").loss_agg_mode == "token-mean"
    assert GRPOConfig(policy_loss="gspo").loss_agg_mode == "seq-mean-token-mean"
    assert GRPOConfig(advantage_estimator="dr_grpo").loss_agg_mode == "seq-mean-token-sum-norm"
    dr = GRPOConfig(advantage_estimator="dr_grpo", loss_agg_mode="seq-mean-token-sum")
    assert dr.loss_agg_mode == "seq-mean-token-sum"
    explicit = GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm")
    assert explicit.loss_agg_mode == "seq-mean-token-sum-norm"
    tiny = GRPOConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    assert (tiny.clip_ratio_low, tiny.clip_ratio_high) == (3e-4, 4e-4)
    # stored resolved: a resolved config written out and read back is the same config
    again = GRPOConfig(policy_loss="gspo", loss_agg_mode=tiny.loss_agg_mode)
    assert again.loss_agg_mode == tiny.loss_agg_mode


@pytest.mark.parametrize(
    "overrides, key, pattern",
    [
        (
            {"policy_loss": "gspo", "loss_agg_mode": "token-mean"},
            "loss_agg_mode",
            r"loss_agg_mode = 'token-mean': must be seq-mean-token-mean with policy_loss gspo: "
            r".*; hint: leave loss_agg_mode out",
        ),
        (
            {"advantage_estimator": "dr_grpo", "loss_agg_mode": "seq-mean-token-mean"},
            "loss_agg_mode",
            r"loss_agg_mode = 'seq-mean-token-mean': must be seq-mean-token-sum-norm or "
            r"seq-mean-token-sum with advantage_estimator dr_grpo",
        ),
        (
            {"advantage_estimator": "dr_grpo", "loss_agg_mode": "token-mean"},
            "loss_agg_mode",
            r"loss_agg_mode = 'token-mean': must be seq-mean-token-sum-norm or",
        ),
        (
            {"policy_loss": "gspo", "advantage_estimator": "dr_grpo"},
            "advantage_estimator",
            r"advantage_estimator = 'dr_grpo': cannot be combined with policy_loss gspo.*; "
            r"hint: use advantage_estimator grpo with normalize_advantage_by_std: false",
        ),
    ],
)
def test_config_rejects_contradicting_combinations(overrides, key, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        GRPOConfig(**overrides)
    assert info.value.key == key


def test_overlong_buffer_is_checked_against_the_response_budget():
    check_overlong_budget(GRPOConfig(overlong_buffer_len=16), "rollout.max_new_tokens", 16)
    with pytest.raises(
        ConfigError,
        match=r"^config error: algorithm.overlong_buffer_len = 17: must be at most "
        r"rollout.max_new_tokens = 16 .*; hint: use a buffer below 16, e.g. 4",
    ):
        check_overlong_budget(GRPOConfig(overlong_buffer_len=17), "rollout.max_new_tokens", 16)


def test_response_budget_is_the_trajectory_budget_when_multi_turn():
    from megatron_async_rl.rollout.config import EnvironmentConfig, RolloutConfig

    run = SimpleNamespace(rollout=RolloutConfig(max_new_tokens=24), environment=EnvironmentConfig())
    assert response_budget(run) == ("rollout.max_new_tokens", 24)
    run.environment = EnvironmentConfig(name="my_env:Env", max_total_tokens=300)
    assert response_budget(run) == ("environment.max_total_tokens", 300)


def test_group_advantages_with_std_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # Group 1: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3. Group 2: all equal -> 0.
    std = math.sqrt(1.0 / 3.0)
    a = 0.5 / (std + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4, normalize_by_std=True, eps=1e-6)
    torch.testing.assert_close(adv, expected)
    assert abs(a - 0.866025) < 1e-5


def test_group_advantages_without_std_and_with_group_ids():
    rewards = torch.tensor([3.0, 1.0, 0.0, 2.0, 5.0])
    group_ids = torch.tensor([7, 2, 7, 2, 9])  # groups {0, 2}, {1, 3}, {4}
    adv = group_advantages(rewards, group_ids, normalize_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -1.5, 0.5, 0.0]))
    adv_std = group_advantages(rewards, group_ids, normalize_by_std=True, eps=0.0)
    # Pairs: |r - mean| = d, unbiased std = sqrt(2 d^2 / 1) = d * sqrt(2) -> +-1/sqrt(2).
    s = 1.0 / math.sqrt(2.0)
    torch.testing.assert_close(adv_std, torch.tensor([s, -s, -s, s, 0.0]))


def test_group_of_one_gets_zero_advantage_and_int_rewards_work():
    adv = group_advantages(torch.tensor([4, 0, 7]), 1)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.zeros(3))


def test_group_advantages_rejects_bad_groups():
    with pytest.raises(ValueError, match="5 samples do not split into groups of 2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group size must be an int >= 1"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"group_ids_B has shape \(3,\); expected \(4,\)"):
        group_advantages(torch.zeros(4), torch.zeros(3))
    with pytest.raises(ValueError, match="rewards_B must be 1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_dynamic_filter_drops_zero_variance_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.2])
    keep, num_dropped = dynamic_filter(rewards, 3)
    # Groups: [1, 0, 1] varies, [1, 0, 0] varies, [0.5, 0.5, 0.2] varies: nothing dropped.
    assert num_dropped == 0 and bool(keep.all())
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, -2.0, -2.0, -2.0])
    keep, num_dropped = dynamic_filter(rewards, 3)
    assert keep.dtype == torch.bool and num_dropped == 2
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    keep, num_dropped = dynamic_filter(torch.tensor([0.0, 3.0, 3.0]), torch.tensor([1, 2, 2]))
    assert keep.tolist() == [False, False, False] and num_dropped == 2


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.5, -0.2]], dtype=torch.float64)
    pairs = [(-1.0, -1.5), (-0.5, -0.5), (-2.0, -0.2)]
    k1 = [lp - r for lp, r in pairs]
    k2 = [0.5 * (lp - r) ** 2 for lp, r in pairs]
    k3 = [math.exp(r - lp) - (r - lp) - 1 for lp, r in pairs]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([k1], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([k2], dtype=torch.float64))
    for name in ("k3", "low_var_kl"):
        out = kl_penalty(logp, ref, name)
        torch.testing.assert_close(out, torch.tensor([k3], dtype=torch.float64))
    assert abs(k3[2] - (math.exp(1.8) - 2.8)) < 1e-12 and min(k3) >= 0.0
    with pytest.raises(ValueError, match="unknown KL estimator 'k5'"):
        kl_penalty(logp, ref, "k5")


def test_k3_is_clamped_and_its_gradient_is_one_minus_ratio():
    logp = torch.tensor([[-30.0, 0.0, -0.3]], requires_grad=True)
    ref = torch.tensor([[0.0, -40.0, -0.1]])
    kl = kl_penalty(logp, ref, "k3")
    # Token 0: exp(30) overflows the value bound -> 10. Token 1: ref - logp = -40 is clamped
    # to -20, exp(-20) + 20 - 1 ~ 19 -> 10. Token 2: exp(0.2) - 0.2 - 1.
    assert kl[0, 0].item() == 10.0 and kl[0, 1].item() == 10.0
    assert abs(kl[0, 2].item() - (math.exp(0.2) - 1.2)) < 1e-6
    kl.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); 0 where clamped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.0 - math.exp(0.2)]]))


def test_kl_reward_subtracts_coef_times_summed_real_token_kl():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 5.0], [0.3, -0.1, 0.4]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = kl_reward(rewards, kl, mask, coef=0.5)
    torch.testing.assert_close(out, torch.tensor([1.0 - 0.5 * 0.3, 0.0 - 0.5 * 0.6]))
    assert not out.requires_grad
