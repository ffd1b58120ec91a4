"""The recipe's `scheduler:` section (`scheduler.config.SchedulerConfig`).

Contract checked: the defaults are the synchronous trainer; every field refuses a wrong value
with a ConfigError naming the (relative) key, the value and the rule; in_flight updates with
zero steps ahead warn that the setting has no effect; validation is due at versions 0, E, 2E...
and never when off. (That the module imports without torch is checked in `test_layering.py`.)
Nothing is faked.
"""

import logging

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.scheduler.config import SchedulerConfig


def test_defaults_are_synchronous():
    cfg = SchedulerConfig()
    assert cfg.synchronous and cfg.weight_update_mode == "wait"
    assert (cfg.queue_capacity, cfg.stage_timeout_s, cfg.validation_every) == (2, 600.0, 0)
    assert not any(cfg.validation_due(v) for v in range(5))


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("generate_ahead_steps", -1, r"must be an integer >= 0; hint: 0 is synchronous"),
        ("generate_ahead_steps", 1.0, "must be an integer >= 0"),
        ("generate_ahead_steps", True, "must be an integer >= 0"),
        ("weight_update_mode", "pause", "must be one of wait, in_flight"),
        ("in_flight_pause", "abort", "must be one of retract, in_place"),
        ("queue_capacity", 0, "must be an integer >= 1"),
        ("stage_timeout_s", "10", "must be a finite number of seconds > 0"),
        ("stage_timeout_s", float("inf"), "must be a finite number of seconds > 0"),
        ("stage_timeout_s", 0, r"must be a finite number of seconds > 0; hint: every wait"),
        ("validation_every", -5, r"must be an integer >= 0; hint: 0 turns validation off"),
        ("validation_version", 3, "must be one of exact, latest"),
    ],
)
def test_bad_values_are_refused(field, value, rule):
    with pytest.raises(ConfigError, match=rf"^config error: {field} = .*: {rule}") as info:
        SchedulerConfig(**{field: value})
    assert info.value.key == field and info.value.value is value


def test_in_flight_without_steps_ahead_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_async_rl.scheduler.config"):
        SchedulerConfig(weight_update_mode="in_flight")
        SchedulerConfig(weight_update_mode="in_flight", generate_ahead_steps=1)
    assert len(caplog.records) == 1
    assert "in_flight has no effect with generate_ahead_steps = 0" in caplog.text


def test_validation_due():
    cfg = SchedulerConfig(validation_every=3, validation_version="latest")
    assert [v for v in range(10) if cfg.validation_due(v)] == [0, 3, 6, 9]
