"""The recipe's `critic:` section (`algorithms.critic_config.CriticConfig`): defaults and errors.

Contract: the defaults are gamma 1.0, lam 0.95, value_clip 0.2, loss_agg_mode token-mean,
warmup_steps 0, whiten_advantages true, init policy and value_head_init_std 0.0; every value a
user can get wrong raises one `ConfigError` line naming the key (relative here, `critic.gamma`
through the recipe loader's `build_dataclass`), the value received and the rule. The section is
built through the loader's generic dataclass builder directly (not yet a schema field). Nothing is
faked.
"""

import pytest

from megatron_async_rl.algorithms.config import LOSS_AGG_MODES
from megatron_async_rl.algorithms.critic_config import CriticConfig
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.recipe.tree import build_dataclass


def test_defaults():
    cfg = CriticConfig()
    assert (cfg.gamma, cfg.lam, cfg.value_clip) == (1.0, 0.95, 0.2)
    assert (cfg.loss_agg_mode, cfg.warmup_steps) == ("token-mean", 0)
    assert cfg.whiten_advantages is True
    assert (cfg.init, cfg.value_head_init_std) == ("policy", 0.0)


def test_valid_values_are_kept():
    cfg = CriticConfig(gamma=1, lam=0, value_clip=None, loss_agg_mode="seq-mean-token-sum",
                       warmup_steps=5, whiten_advantages=False, init="/models/rm",
                       value_head_init_std=0.02)  # fmt: skip
    assert cfg.gamma == 1.0 and isinstance(cfg.gamma, float)
    assert (cfg.lam, cfg.value_clip, cfg.warmup_steps, cfg.init) == (0.0, None, 5, "/models/rm")
    for mode in LOSS_AGG_MODES:
        assert CriticConfig(loss_agg_mode=mode).loss_agg_mode == mode


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("gamma", 1.5, r"must be a finite number in \[0, 1\]"),
        ("gamma", -0.1, r"must be a finite number in \[0, 1\]"),
        ("gamma", True, r"must be a finite number in \[0, 1\]"),
        ("gamma", float("nan"), r"must be a finite number in \[0, 1\]"),
        ("lam", 1.01, r"must be a finite number in \[0, 1\]"),
        ("lam", "0.9", r"must be a finite number in \[0, 1\]"),
        ("value_clip", 0, r"must be a finite number > 0 or null"),
        ("value_clip", -0.2, r"must be a finite number > 0 or null"),
        ("loss_agg_mode", "mean", r"must be one of token-mean, seq-mean-token-mean"),
        ("warmup_steps", -1, r"must be an integer >= 0"),
        ("warmup_steps", 1.5, r"must be an integer >= 0"),
        ("whiten_advantages", "yes", r"must be true or false"),
        ("init", "", r"must be policy or a Hugging Face model directory"),
        ("init", "   ", r"must be policy or a Hugging Face model directory"),
        ("init", 3, r"must be policy or a Hugging Face model directory"),
        ("value_head_init_std", -0.01, r"must be a finite number >= 0"),
    ],
)
def test_errors_name_key_value_and_rule(key, value, rule):
    with pytest.raises(ConfigError, match=rf"config error: {key} = .*: {rule}") as info:
        CriticConfig(**{key: value})
    err = info.value
    assert err.key == key
    assert err.value is value or err.value == value
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"gamma": 1.5}, r"critic\.gamma = 1\.5: must be a finite number in \[0, 1\]; hint: GAE"),
        ({"lam": -1}, r"critic\.lam = -1: must be a finite number in \[0, 1\]"),
        ({"value_clip": 0}, r"critic\.value_clip = 0: must be a finite number > 0 or null"),
        ({"gama": 0.9}, r"critic\.gama = 0\.9: unknown key; hint: did you mean critic\.gamma\?"),
    ],
)
def test_errors_through_the_recipe_loader_are_prefixed(section, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_dataclass(CriticConfig, section, "critic")
    assert "\n" not in str(info.value)


def test_recipe_loader_builds_the_section():
    section = {"gamma": 0.99, "value_clip": None, "init": "policy"}
    cfg = build_dataclass(CriticConfig, section, "critic")
    assert (cfg.gamma, cfg.value_clip, cfg.lam) == (0.99, None, 0.95)
