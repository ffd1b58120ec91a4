"""The value checks every config dataclass uses (`config/checks.py`): one wording per rule.

Contract: each check returns the value when it passes and otherwise raises `ConfigError` naming
the key, the value received and the whole rule (type and range in one sentence), plus the hint
when one is given; a bool is never an integer or a number; `optional=True` accepts None and
says "or null". Nothing is faked.
"""

from __future__ import annotations

import math

import pytest

from megatron_async_rl.config.checks import (
    require_bool,
    require_choice,
    require_int,
    require_number,
)
from megatron_async_rl.config.errors import ConfigError


def _raises(pattern: str, check, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError, match=pattern) as info:
        check(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    "value, kwargs, rule",
    [
        (0, {"minimum": 1}, "must be an integer >= 1"),
        (True, {"minimum": 1}, "must be an integer >= 1"),
        (2.0, {"minimum": 0}, "must be an integer >= 0"),
        ("3", {}, "must be an integer"),
        (5, {"minimum": 1, "maximum": 4}, r"must be an integer in \[1, 4\]"),
        (None, {"minimum": 1}, "must be an integer >= 1"),
        (0, {"minimum": 1, "optional": True}, "must be an integer >= 1 or null"),
    ],
)
def test_require_int_names_key_value_and_rule(value, kwargs, rule):
    err = _raises(rf"^config error: n = {value!r}: {rule}$", require_int, "n", value, **kwargs)
    assert (err.key, err.value, err.hint) == ("n", value, None)


def test_require_int_passes_and_carries_the_hint():
    assert require_int("n", 3, 1) == 3
    assert require_int("n", None, 1, optional=True) is None
    err = _raises(
        r"n = -1: must be an integer >= 0; hint: 0 is off$",
        require_int,
        "n",
        -1,
        0,
        hint="0 is off",
    )
    assert err.hint == "0 is off"


@pytest.mark.parametrize(
    "value, kwargs, rule",
    [
        (0, {"gt": 0}, "must be a finite number > 0"),
        (True, {"ge": 0}, "must be a finite number >= 0"),
        ("1", {}, "must be a finite number"),
        (math.nan, {"ge": 0}, "must be a finite number >= 0"),
        (math.inf, {"gt": 0, "unit": "seconds"}, "must be a finite number of seconds > 0"),
        (1.0, {"ge": 0, "lt": 1}, r"must be a finite number in \[0, 1\)"),
        (0, {"gt": 0, "le": 1, "optional": True}, r"must be a finite number in \(0, 1\] or null"),
        (2.5, {"le": 2}, "must be a finite number <= 2"),
    ],
)
def test_require_number_names_key_value_and_rule(value, kwargs, rule):
    err = _raises(rf"^config error: x = .*: {rule}$", require_number, "x", value, **kwargs)
    assert err.key == "x" and err.value is value


def test_require_number_returns_a_float():
    assert require_number("x", 2, gt=0) == 2.0 and isinstance(require_number("x", 2), float)
    assert require_number("x", None, optional=True) is None
    with pytest.raises(TypeError, match="at most one lower"):
        require_number("x", 1, gt=0, ge=0)


def test_require_choice_and_bool():
    assert require_choice("mode", "a", ("a", "b")) == "a"
    _raises(
        r"^config error: mode = 'c': must be one of a, b$", require_choice, "mode", "c", ("a", "b")
    )
    _raises(r"^config error: mode = 1: must be one of a, b$", require_choice, "mode", 1, "ab")
    assert require_bool("flag", False) is False
    _raises(r"^config error: flag = 'yes': must be true or false$", require_bool, "flag", "yes")
    _raises(r"^config error: flag = 1: must be true or false$", require_bool, "flag", 1)
