"""`roles.memory`: a rank's weights counted from the recipe equal the tensors it really loads.

Contracts checked: for a dense and a MoE tiny model and layouts with TP, PP and EP,
`stage_numel` equals the element count of the busiest rank's `shards.stage_state_dict_from_hf`
slices (vocab padding aside: the tiny models need none), and `model_numel` that of the whole
checkpoint; the train role adds grads and Adam's state by the stated rules (bf16 params: bf16
grads, fp32 main copy and moments, divided over DP with the distributed optimizer). Pure; tiny
checkpoints written here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_async_rl.distributed.layout import RoleGrid
from megatron_async_rl.models.dims import ModelDims
from megatron_async_rl.models.hf_checkpoint import HFTensorReader, read_hf_config
from megatron_async_rl.models.hf_config import megatron_args_from_hf
from megatron_async_rl.models.shards import stage_state_dict_from_hf
from megatron_async_rl.models.tiny import write_tiny_model
from megatron_async_rl.roles import memory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family in ("llama", "qwen3_moe"):
        path = write_tiny_model(tmp_path_factory.mktemp(family), family, seed=4)
        args = megatron_args_from_hf(read_hf_config(path))
        out[family] = (path, args, ModelDims.from_megatron_args(args))
    return out


GRIDS = [dict(tp=2, pp=1, dp=1), dict(tp=1, pp=2, dp=1), dict(tp=2, pp=2, dp=1),
         dict(tp=1, pp=1, dp=2, ep=2), dict(tp=2, pp=1, dp=2, ep=2, etp=1)]  # fmt: skip


CASES = [(f, g) for f in ("llama", "qwen3_moe") for g in GRIDS
         if f == "qwen3_moe" or g.get("ep", 1) == 1]  # fmt: skip


@pytest.mark.parametrize(("family", "sizes"), CASES, ids=str)
def test_counted_weights_equal_the_loaded_slices(models, family, sizes):
    path, _, dims = models[family]
    grid = RoleGrid(offset=0, **sizes)
    reader = HFTensorReader(path)
    loaded = 0
    for pp_rank in range(grid.pp):
        for ep_rank in range(grid.ep):
            local = stage_state_dict_from_hf(
                reader.read, dims, tp_size=grid.tp, pp_rank=pp_rank, pp_size=grid.pp,
                ep_rank=ep_rank, ep_size=grid.ep, etp_size=grid.etp,
            )  # fmt: skip
            loaded = max(loaded, sum(t.numel() for t in local.values()))
    assert memory.stage_numel(dims, grid) == loaded
    whole = sum(reader.read(k).numel() for k in reader.keys() if k != "lm_head.weight"
                or not dims.tied_embeddings)  # fmt: skip
    assert memory.model_numel(dims) == whole


def test_train_adds_grads_and_adam_state_by_the_stated_rules(models):
    _, args, dims = models["llama"]
    layout = SimpleNamespace(
        parallelism={"train": None}, windows=[SimpleNamespace(roles=("train",))],
        grid=lambda role: RoleGrid(offset=0, tp=1, pp=1, dp=4),
    )  # fmt: skip
    cfg = SimpleNamespace(
        role_megatron_args={"train": {**args, "bf16": True, "use_distributed_optimizer": True}},
        scheduler=SimpleNamespace(use_async_loop=False),
    )
    (train,) = memory.plan_memory(cfg, layout)
    n = memory.model_numel(dims)
    assert train.device == {"weights": 2 * n, "grads": 2 * n, "optimizer": 12 * n // 4}
    assert train.host == {"checkpoint read": 2 * n}
    # with delta weight sync, a sender keeps its messages: its pipeline stage in the train dtype
    cfg.weight_sync = SimpleNamespace(delta=True)
    (train,) = memory.plan_memory(cfg, layout)
    assert train.host == {"checkpoint read": 2 * n, "delta bases": 2 * n}


def test_shared_memory_is_checked_before_an_engine_starts(models):
    """The real /dev/shm: a need above what is free is refused naming both sizes and the key."""
    import shutil

    from megatron_async_rl.config.errors import ConfigError

    free = shutil.disk_usage("/dev/shm").free
    memory.check_shared_memory(1 << 20)
    with pytest.raises(ConfigError) as info:
        memory.check_shared_memory(free + memory.GiB)
    text = str(info.value)
    assert "scheduler.use_async_loop" in text and "/dev/shm has" in text and "--shm-size" in text
    _, args, dims = models["llama"]
    cfg = SimpleNamespace(
        role_megatron_args={"train": {**args, "bf16": True}},
        scheduler=SimpleNamespace(use_async_loop=True),
    )
    assert memory.staging_bytes(cfg) == 2 * memory.model_numel(dims)
    cfg.scheduler.use_async_loop = False
    assert memory.staging_bytes(cfg) == 0
