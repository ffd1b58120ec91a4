"""The PPO mini-batch planner and Megatron's batch-size rules, with no process group.

Contract: `plan_minibatches` gives B / G optimizer steps per epoch (one with G None) for
`ppo_epochs` epochs, each epoch covering every sample index exactly once; in order without
shuffle or with one mini-batch per epoch; with shuffle a permutation that depends on (seed,
step, epoch) only, the same in a fresh interpreter (every rank and rerun agree).
`optimizer_steps_per_rl_step` counts the plan's steps. `check_minibatches` and the planner
reject a G that does not divide the batch, and `check_minibatches` a G that is not a multiple of
micro-batch size x data-parallel size, with a ConfigError naming `--global-batch-size` and the
values; `GRPOConfig` validates `ppo_epochs` and `shuffle_minibatches`. Along the plan, as
`roles/learn.py:_optimizer_step` runs it (advantages and the rejection mask over the whole batch,
each mini-batch's counts as the denominators of its micro-batches), every policy loss, advantage
estimator, loss mode and off-policy correction gives micro-batch losses and gradients that sum to
the mini-batch's own. Nothing is faked.
"""

import subprocess
import sys

import pytest
import torch

from megatron_async_rl.algorithms.advantages import compute_advantages
from megatron_async_rl.algorithms.config import GRPOConfig
from megatron_async_rl.algorithms.corrections import behaviour_mask
from megatron_async_rl.algorithms.losses import total_loss
from megatron_async_rl.algorithms.minibatch import (
    check_minibatches,
    optimizer_steps_per_rl_step,
    plan_minibatches,
)
from megatron_async_rl.config.errors import ConfigError


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("num_samples, gbs, epochs", [(16, 4, 1), (16, 8, 3), (12, None, 2)])
def test_each_epoch_covers_every_sample_once(num_samples, gbs, epochs, shuffle):
    plan = plan_minibatches(num_samples, gbs, epochs, shuffle, seed=7, step=3)
    assert len(plan) == optimizer_steps_per_rl_step(num_samples, gbs, epochs)
    per_epoch = num_samples // (gbs or num_samples)
    assert len(plan) == per_epoch * epochs
    for epoch in range(epochs):
        steps = plan[epoch * per_epoch : (epoch + 1) * per_epoch]
        assert all(len(s) == (gbs or num_samples) for s in steps)
        assert sorted(i for s in steps for i in s) == list(range(num_samples))


def test_without_shuffle_the_plan_is_in_order():
    plan = plan_minibatches(8, 4, 2, False, seed=7, step=3)
    assert plan == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2


def test_one_minibatch_per_epoch_is_never_shuffled():
    # G None or G = B: the single step over the whole batch, in the order of today's step.
    assert plan_minibatches(8, None, 2, True, seed=7, step=3) == [list(range(8))] * 2
    assert plan_minibatches(8, 8, 1, True, seed=7, step=3) == [list(range(8))]


def test_shuffle_is_deterministic_and_varies_with_seed_step_and_epoch():
    plan = plan_minibatches(32, 8, 2, True, seed=7, step=3)
    assert plan == plan_minibatches(32, 8, 2, True, seed=7, step=3)
    assert plan[:4] != plan[4:]  # each epoch draws its own permutation
    assert [i for s in plan[:4] for i in s] != list(range(32))
    assert plan != plan_minibatches(32, 8, 2, True, seed=8, step=3)
    assert plan != plan_minibatches(32, 8, 2, True, seed=7, step=4)


def test_shuffle_is_the_same_in_a_fresh_interpreter():
    # A rank or a rerun is another process (with its own PYTHONHASHSEED): it must split alike.
    code = (
        "from megatron_async_rl.algorithms.minibatch import plan_minibatches;"
        "print(plan_minibatches(32, 8, 2, True, seed=7, step=3))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == str(plan_minibatches(32, 8, 2, True, seed=7, step=3))


def test_optimizer_steps_per_rl_step():
    assert optimizer_steps_per_rl_step(64, None, 1) == 1
    assert optimizer_steps_per_rl_step(64, 16, 1) == 4
    assert optimizer_steps_per_rl_step(64, 16, 2) == 8


@pytest.mark.parametrize(
    "args, pattern",
    [
        (
            (12, 8, 1, 1),
            r"--global-batch-size = 8: --global-batch-size \(samples per optimizer step\) must "
            r"divide the rollout batch of 12 samples",
        ),
        ((4, 8, 1, 1), r"--global-batch-size = 8: .* must divide the rollout batch of 4 samples"),
        ((12, 0, 1, 1), r"--global-batch-size = 0: .* must divide the rollout batch of 12"),
        (
            (16, 4, 2, 4),
            r"--global-batch-size = 4: --global-batch-size must be a multiple of the micro-batch "
            r"size x data-parallel size = 2 x 4 = 8",
        ),
        ((18, 6, 4, 1), r"--global-batch-size = 6: .* multiple of .* = 4 x 1 = 4"),
    ],
)
def test_check_minibatches_rejects(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_minibatches(*args)


def test_check_minibatches_names_the_recipe_key_under_a_prefix():
    with pytest.raises(ConfigError, match=r"^config error: roles.train.megatron.global_batch_size"):
        check_minibatches(12, 5, 1, 1, "roles.train.megatron")


def test_check_minibatches_accepts():
    check_minibatches(16, None, 3, 3)  # one step over the whole batch: Megatron's rule is moot
    check_minibatches(16, 8, 2, 2)
    check_minibatches(16, 16, 1, 4)


def test_planner_rejects_a_global_batch_size_that_does_not_divide_the_batch():
    with pytest.raises(ConfigError, match=r"--global-batch-size = 5: .* batch of 12 samples"):
        plan_minibatches(12, 5, 1, True, seed=0, step=0)
    with pytest.raises(ConfigError, match=r"--global-batch-size = 5: .* batch of 12 samples"):
        optimizer_steps_per_rl_step(12, 5, 1)


def test_config_defaults_and_validation():
    cfg = GRPOConfig()
    assert (cfg.ppo_epochs, cfg.shuffle_minibatches) == (1, True)
    with pytest.raises(ConfigError, match=r"ppo_epochs = 0: must be an integer >= 1"):
        GRPOConfig(ppo_epochs=0)
    with pytest.raises(ConfigError, match=r"ppo_epochs = 1.5: must be an integer >= 1"):
        GRPOConfig(ppo_epochs=1.5)
    with pytest.raises(ConfigError, match=r"shuffle_minibatches = 'yes': must be true or false"):
        GRPOConfig(shuffle_minibatches="yes")


LOSS_VARIANTS = [
    {"policy_loss": "gspo", "advantage_estimator": "rloo", "off_policy_correction": "tis_seq"},
    {"advantage_estimator": "dr_grpo", "off_policy_mask": "token", "off_policy_mask_low": 0.7},
    {"advantage_estimator": "reinforce_pp", "loss_agg_mode": "seq-mean-token-sum"},
    {"advantage_estimator": "reinforce_pp_baseline", "off_policy_correction": "decoupled",
     "off_policy_mask": "geo_mean", "off_policy_mask_low": 0.8, "off_policy_mask_high": 1.25},
]  # fmt: skip


@pytest.mark.parametrize("variant", LOSS_VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_every_loss_variant_is_exact_over_the_planned_minibatches(variant):
    gen = torch.Generator().manual_seed(11)
    num_samples, length, group = 12, 6, 3
    cfg = GRPOConfig(num_samples_per_prompt=group, kl_coef=0.05, entropy_coef=0.01, **variant)
    lengths = torch.randint(0, length + 1, (num_samples,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    old = -2 * torch.rand(num_samples, length, generator=gen, dtype=torch.float64)
    logp = old + 0.3 * torch.randn(num_samples, length, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(num_samples, length, generator=gen, dtype=torch.float64)
    behaviour = old + 0.3 * torch.randn(num_samples, length, generator=gen, dtype=torch.float64)
    entropy = torch.rand(num_samples, length, generator=gen, dtype=torch.float64)
    rewards = torch.randint(0, 3, (num_samples,), generator=gen).double()
    keep = behaviour_mask(old, behaviour, mask, cfg)  # whole batch, as the train stage cuts it
    if cfg.off_policy_mask != "none":
        assert 0 < int((mask & ~keep).sum()) < int(mask.sum())
    mask = mask & keep
    adv = compute_advantages(rewards, mask, group, cfg)

    def loss_and_grad(rows, num_tokens, num_seqs):
        leaf = logp[rows].clone().requires_grad_()
        loss, _ = total_loss(
            leaf, old[rows], adv[rows], mask[rows], cfg, behaviour_logp_BT=behaviour[rows],
            ref_logp_BT=ref[rows], entropy_BT=entropy[rows], num_tokens_global=num_tokens,
            num_seqs_global=num_seqs, token_sum_norm=length,
        )  # fmt: skip
        loss.backward()
        return loss.item(), leaf.grad

    for samples in plan_minibatches(num_samples, 6, 2, True, seed=7, step=1):
        rows = torch.tensor(samples)
        num_tokens, num_seqs = mask[rows].sum(), (mask[rows].sum(-1) > 0).sum()
        whole_loss, whole_grad = loss_and_grad(rows, None, None)
        micro = [loss_and_grad(chunk, num_tokens, num_seqs) for chunk in rows.split(2)]
        assert abs(whole_loss - sum(loss for loss, _ in micro)) < 1e-12
        torch.testing.assert_close(torch.cat([grad for _, grad in micro]), whole_grad)
