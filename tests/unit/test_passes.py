"""Which passes a step runs besides training (`algorithms.passes`).

Contracts: `auto` takes the logp role where it is placed, else the train forward's own where
that is exact (zero steps ahead, one optimizer step, nothing needing old log-probs before the
step), else the engine's; each explicit choice that cannot work is refused naming
`algorithm.old_logprobs`; the ref pass runs every step under a KL term, every
`kl_metrics_every` steps without one, never with 0; placed roles that nothing runs are the dry
run's warnings; the dry run says where the old log-probs come from and what was not placed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_async_rl.algorithms import passes
from megatron_async_rl.algorithms.config import GRPOConfig
from megatron_async_rl.config.errors import ConfigError


def _algo(**kw) -> GRPOConfig:
    return GRPOConfig(**kw)


@pytest.mark.parametrize(
    "placed,ahead,steps,kw,expected",
    [
        (("train", "logp", "ref"), 0, 1, {}, "logp"),
        (("train",), 0, 1, {}, "trainer"),
        (("train",), 1, 1, {}, "engine"),  # one step ahead: the engine's
        (("train",), 0, 4, {}, "engine"),  # four optimizer steps: the engine's
        (("train",), 0, 1, {"off_policy_mask": "token"}, "engine"),  # masks before the step
        (("train", "ref"), 0, 1, {"kl_coef": 0.1, "kl_mode": "reward"}, "engine"),
        (("train", "ref"), 0, 1, {"kl_coef": 0.1}, "trainer"),  # KL in the loss: fine
    ],
)
def test_auto(placed, ahead, steps, kw, expected):
    assert passes.resolve_old_logprobs(_algo(**kw), placed, ahead, steps) == expected


@pytest.mark.parametrize(
    "mode,placed,ahead,steps,kw,replay,rule",
    [
        ("logp", ("train",), 0, 1, {}, "off", "none is placed"),
        ("trainer", ("train",), 0, 2, {}, "off", "2 optimizer steps per RL step"),
        ("trainer", ("train",), 2, 1, {}, "off", "generate_ahead_steps 2"),
        ("trainer", ("train",), 0, 1, {"off_policy_mask": "seq"}, "off", "off-policy mask"),
        ("engine", ("train",), 1, 1, {"off_policy_correction": "decoupled"}, "off", "proximal"),
        ("auto", ("train",), 1, 1, {"off_policy_correction": "decoupled"}, "off", "proximal"),
        ("engine", ("train",), 1, 1, {}, "r2", "routing the logp pass records"),
    ],
)
def test_refused(mode, placed, ahead, steps, kw, replay, rule):
    with pytest.raises(ConfigError, match=rule) as err:
        passes.resolve_old_logprobs(_algo(old_logprobs=mode, **kw), placed, ahead, steps, replay)
    assert err.value.key == "algorithm.old_logprobs"


def test_the_ref_pass_runs_when_something_uses_it():
    assert all(passes.ref_runs(_algo(kl_coef=0.05, kl_metrics_every=0), s) for s in range(4))
    assert [passes.ref_runs(_algo(kl_metrics_every=3), s) for s in range(7)] == [
        True, False, False, True, False, False, True]  # fmt: skip
    assert not any(passes.ref_runs(_algo(kl_metrics_every=0), s) for s in range(4))


def _cfg(roles, **algo):
    return SimpleNamespace(roles=SimpleNamespace(placed_roles=lambda: roles),
                           algorithm=_algo(**algo))  # fmt: skip


def test_unused_roles_are_the_dry_runs_warnings():
    assert passes.unused_roles(_cfg(("train", "logp", "ref"), old_logprobs="logp")) == []
    warned = passes.unused_roles(
        _cfg(("train", "logp", "ref"), old_logprobs="engine", kl_metrics_every=0)
    )
    assert [w.split(":")[0] for w in warned] == ["ref", "logp"]
    text = passes.describe(_cfg(("train",), old_logprobs="trainer"))
    assert "the train forward's own, detached" in text
    assert "not placed (no KL term): no reference model resident" in text
    text = passes.describe(_cfg(("train", "ref"), old_logprobs="engine", kl_coef=0.1))
    assert "the engine's (behaviour policy" in text and "every step (KL term in the loss" in text
