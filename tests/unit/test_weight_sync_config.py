"""The recipe's `weight_sync:` section (`weight_sync.config.WeightSyncConfig`).

Contract checked: defaults are 512 / 128 MiB (auto transport and bridge, 2 attempts) and
convert to bytes; every field refuses a wrong value with a ConfigError naming the key, the
value and the rule; `RunConfig` carries the section; the bridge resolves from the
configuration, the world's backend and where the weights are. (That the module imports
without torch is checked in `test_layering.py`.) Nothing is faked.
"""

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.weight_sync.config import WeightSyncConfig


def test_defaults_and_bytes():
    cfg = WeightSyncConfig()
    assert (cfg.produce_bucket_mb, cfg.consume_bucket_mb) == (512, 128)
    assert (cfg.produce_bytes, cfg.consume_bytes) == (512 << 20, 128 << 20)
    assert WeightSyncConfig(consume_bucket_mb=0.5).consume_bytes == 1 << 19
    assert (cfg.transport, cfg.bridge, cfg.max_attempts) == ("auto", "auto", 2)
    assert (cfg.delta, cfg.full_every) == (False, 20)


def test_run_config_has_the_section():
    from megatron_async_rl.recipe.schema import RunConfig

    assert RunConfig.__dataclass_fields__["weight_sync"].default_factory is WeightSyncConfig


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("produce_bucket_mb", 0, "must be a finite number of MiB > 0"),
        ("produce_bucket_mb", "512", "must be a finite number of MiB > 0"),
        ("consume_bucket_mb", True, "must be a finite number of MiB > 0"),
        ("consume_bucket_mb", 0.001, r"must be at least 4 KiB"),
        ("transport", "nccl", "must be one of auto, broadcast"),
        ("bridge", "nccl", "must be one of auto, host, device"),
        ("max_attempts", 0, "must be an integer >= 1"),
        ("max_attempts", 1.5, "must be an integer >= 1"),
        ("delta", "yes", "must be true or false"),
        ("full_every", 0, "must be an integer >= 1"),
    ],
)
def test_bad_values_are_refused(field, value, rule):
    with pytest.raises(ConfigError, match=rf"^config error: {field} = .*: {rule}") as info:
        WeightSyncConfig(**{field: value})
    assert info.value.key == field and info.value.value is value


@pytest.mark.parametrize(
    "bridge,backend,on_cuda,expected,engine_tp",
    [
        ("auto", "nccl", True, "cuda", 1),
        ("auto", "gloo", True, "cpu", 1),  # a CUDA trainer in a gloo world: host memory
        ("device", "gloo", True, "cuda", 1),  # asked for: GPU slots over gloo's CUDA path
        ("host", "nccl", True, "cpu", 1),
        ("device", "gloo", False, "cpu", 1),  # on CPU both bridges are the host one
        ("auto", "gloo", False, "cpu", 1),
        ("auto", "nccl", True, "cpu", 2),  # TP-2 engines take host memory (finding 8)
        ("device", "nccl", True, "cuda", 1),
    ],
)
def test_bridge_resolves_from_config_backend_and_weights(
    bridge, backend, on_cuda, expected, engine_tp
):
    """Which bridge the train ranks choose (and tell the receivers in the plan key)."""
    from megatron_async_rl.weight_sync.broadcast import _bridge_device

    WeightSyncConfig(bridge=bridge)  # a valid value
    assert _bridge_device(bridge, backend, on_cuda, engine_tp) == expected
