"""`LearnSide.train`'s advantage stage: reward shaping, loss-mask filters, the estimator and the
batch metrics, on samples laid out by the real `build_batch`.

Contract: DAPO's overlong penalty is added to the rewards before the advantages (L_max =
rollout.max_new_tokens), `mask_truncated` zeroes the loss mask of samples cut by the length limit,
`off_policy_mask` removes the rejected tokens from the loss mask, `advantage_estimator` runs on
the shaped rewards, and the batch metrics carry reward/overlong_penalty_mean,
samples/masked_truncated, offpolicy/masked_token_frac and masked_seq_frac, and mismatch/k1,
k3_kl and max_abs over all response tokens and over the trained ones (`/trained`). A buffer past
L_max is refused with a ConfigError. The defaults leave rewards, mask and GRPO advantages as they
were. Faked: the LearnSide instance (only the fields `train` reads), its one-rank gather, and no
train role (the optimizer steps are `train_on_batch`'s, tested elsewhere).
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.algorithms.config import GRPOConfig
from megatron_async_rl.algorithms.grpo import group_advantages
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.distributed import devices
from megatron_async_rl.roles.learn import LearnSide
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.rollout.batch import build_batch
from megatron_async_rl.rollout.config import EnvironmentConfig, RolloutConfig
from megatron_async_rl.rollout.generation import Sample

# (response length, finish reason, reward); two groups of two; L_max = 8
SAMPLES = [(3, "stop", 1.0), (8, "length", 1.0), (6, "stop", 0.0), (2, "stop", 1.0)]
PROMPT = [5, 6]


def _work():
    samples = [
        Sample(
            uid=f"p{i // 2}",
            prompt_index=i // 2,
            sample_index=i % 2,
            prompt_ids=PROMPT,
            response_ids=[7] * n,
            response_logprobs=[-1.0 - 0.1 * t for t in range(n)],
            token_versions=["v0"] * n,
            finish_reason=finish,
            answer="",
            reward=reward,
        )  # fmt: skip
        for i, (n, finish, reward) in enumerate(SAMPLES)
    ]
    batch = build_batch(samples, pad_id=0)
    logp = batch["behaviour_logp"].clone()
    # column p - 1 + j holds response token j (p = 2 prompt tokens)
    logp[0, 1 + 0] += math.log(1.5)  # rho 1.5: inside [0.5, 2]
    logp[2, 1 + 4] += math.log(3.0)  # rho 3: rejected by the token mask
    logp[3, 12] = 9.0  # padding: must not count anywhere
    return StepWork(step=0, samples=samples, batch=batch, logp_BT=logp, ref_logp_BT=logp)


def _side(monkeypatch, **algorithm):
    def gather(parts, obj, group):
        parts[0] = obj

    monkeypatch.setattr(devices, "all_gather_object", gather)
    cfg = SimpleNamespace(
        algorithm=GRPOConfig(num_samples_per_prompt=2, **algorithm),
        rollout=RolloutConfig(max_new_tokens=8),
        environment=EnvironmentConfig(),
    )
    side = object.__new__(LearnSide)  # the fields `train` reads, without a writer or a model
    side.cfg, side.roles, side.is_leader, side._quiet_until = cfg, {}, False, 0
    side.groups = SimpleNamespace(megatron_ranks=[0], megatron=None)
    return side


def test_shaping_filters_estimator_and_metrics(monkeypatch):
    side = _side(
        monkeypatch, overlong_buffer_len=4, overlong_penalty_factor=0.5, mask_truncated=True,
        off_policy_mask="token", advantage_estimator="rloo",
    )  # fmt: skip
    work = side.train(_work())

    # penalties: 3 <= 8 - 4: 0; 8 = L_max: -0.5; 6: -(6 - 4) / 4 * 0.5; 2: 0
    shaped = [1.0, 1.0 - 0.5, 0.0 - 0.25, 1.0]
    rloo = [
        shaped[0] - shaped[1],
        shaped[1] - shaped[0],
        shaped[2] - shaped[3],
        shaped[3] - shaped[2],
    ]
    torch.testing.assert_close(work.adv_B, torch.tensor(rloo))
    trained = work.loss_mask_BT
    assert trained[1].sum().item() == 0  # truncated: not trained
    assert trained[2, 1 + 4].item() == 0 and trained[2].sum().item() == 5  # one token rejected
    assert trained[0].sum().item() == 3 and trained[3].sum().item() == 2

    metrics = work.batch_metrics
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx((-0.5 - 0.25) / 4)
    assert metrics["samples/masked_truncated"] == 1.0
    assert metrics["offpolicy/masked_token_frac"] == pytest.approx(1 / 11)  # of 3 + 6 + 2
    assert metrics["offpolicy/masked_seq_frac"] == 0.0
    # d = engine - train = -log rho on two tokens, 0 elsewhere: 19 response tokens, 10 trained
    assert metrics["mismatch/k1"] == pytest.approx(-(math.log(1.5) + math.log(3.0)) / 19)
    assert metrics["mismatch/k1/trained"] == pytest.approx(-math.log(1.5) / 10)
    k3 = {r: r - 1 - math.log(r) for r in (1.5, 3.0)}
    assert metrics["mismatch/k3_kl"] == pytest.approx((k3[1.5] + k3[3.0]) / 19)
    assert metrics["mismatch/k3_kl/trained"] == pytest.approx(k3[1.5] / 10)
    assert metrics["mismatch/max_abs"] == pytest.approx(math.log(3.0))
    assert metrics["mismatch/max_abs/trained"] == pytest.approx(math.log(1.5))


def test_defaults_change_nothing(monkeypatch):
    work = _work()
    mask, rewards = work.batch["mask"].clone(), work.batch["rewards"].clone()
    work = _side(monkeypatch).train(work)
    torch.testing.assert_close(work.loss_mask_BT, mask)
    torch.testing.assert_close(work.adv_B, group_advantages(rewards, 2))
    assert work.batch_metrics["reward/overlong_penalty_mean"] == 0.0
    assert work.batch_metrics["samples/masked_truncated"] == 0.0
    assert work.batch_metrics["offpolicy/masked_token_frac"] == 0.0


def test_a_buffer_past_the_response_budget_is_refused(monkeypatch):
    side = _side(monkeypatch, overlong_buffer_len=9)
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer_len = 9: must be at most "
                       r"rollout.max_new_tokens = 8"):  # fmt: skip
        side.train(_work())


def test_padding_mask_marks_the_positions_after_prompt_and_response():
    from megatron_async_rl.rollout.batch import padding_BT

    batch = _work().batch  # T = 16: the longest sample (2 + 8) rounded up to 8
    padding = padding_BT(batch)
    assert padding.dtype == torch.bool and padding.shape == batch["tokens"].shape
    for row, (n, _, _) in enumerate(SAMPLES):
        assert not padding[row, : len(PROMPT) + n].any()
        assert padding[row, len(PROMPT) + n :].all()
