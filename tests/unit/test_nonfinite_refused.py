"""nan and inf are refused wherever a recipe key or a Megatron flag takes a float: every float
field of every section of the recipe (found by walking `RunConfig`), and Megatron flags on the
command line (`-- --lr nan`) and in a `megatron:` section, each with one error naming the key."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron.parse import (
    normalize_megatron_section,
    parse_megatron_flags,
)
from megatron_async_rl.recipe import schema


def _required(cls, tmp_path) -> dict:
    """Arguments a section needs before its floats can be checked (none for most)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if "roles" in names and cls.__name__ == "RoleGroupSpec":
        return {"roles": ["train"], "ratio": 0.5}
    if cls.__name__ == "RewardModelConfig":
        return {"hf_path": str(tmp_path)}
    return {}


def _float_fields(cls, prefix="", seen=None):
    seen = set() if seen is None else seen
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = typing.get_args(kind)
        for sub in (args or (kind,)):
            if dataclasses.is_dataclass(sub):
                yield from _float_fields(sub, f"{prefix}{f.name}.", seen)
        if kind is float or float in args:
            yield cls, f.name, prefix + f.name


def test_every_float_key_of_a_recipe_refuses_nan_and_inf(tmp_path):
    fields = list(_float_fields(schema.RunConfig))
    assert len(fields) > 35  # the walk reached every section (40 float keys today)
    accepted = []
    for cls, name, key in fields:
        base = cls(**_required(cls, tmp_path))
        for value in (math.nan, math.inf, -math.inf):
            try:
                dataclasses.replace(base, **{name: value})
            except ConfigError as err:
                assert name in str(err) and "finite" in str(err), (key, str(err))
            else:
                accepted.append((key, value))
    assert not accepted, accepted


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_megatron_float_flags_refuse_nan_and_inf(value):
    with pytest.raises(ConfigError) as err:
        parse_megatron_flags(["--lr", value])
    assert "--lr" in str(err.value) and "finite" in str(err.value)
    with pytest.raises(ConfigError) as err:
        normalize_megatron_section({"clip_grad": float(value)}, "megatron")
    assert "megatron.clip_grad" in str(err.value) and "finite" in str(err.value)
