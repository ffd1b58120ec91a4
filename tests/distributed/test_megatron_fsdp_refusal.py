"""Why --use-megatron-fsdp is refused (config/megatron/inventory.py `_FSDP`), checked against the
installed megatron-core rather than taken on trust. Each test pins one release's reason; if an
upgrade changes it, the test fails: revisit the refusal.

Contract, megatron-core's global parallel state uninitialised, the role's groups built by
`distributed.groups` in a world that also holds a generate (engine) rank:
- 0.16.x and 0.19.x: the adapter (`distributed/fsdp/mcore_fsdp_adapter.py`, `_get_dp_tp_mesh`)
  lays its device mesh over `torch.arange(world_size)`, so a role that is not the whole world
  fails to wrap (einops "Shape mismatch"), given its `pg_collection`;
- 0.16.x: the adapter also reads the *global* tensor-parallel group at wrap time (the same
  AssertionError on an H100, one NCCL rank, given a full `pg_collection`);
- 0.19.x: that read is gone, and with the mesh built from the role's two groups instead
  (`_role_mesh`, what a patch would install) a 2-rank role at offset 1 in a 3-rank world wraps a
  tiny GPT, and two steps of megatron-core's distributed optimizer give torch's grad norms and
  weights (a twin under plain autograd, `clip_grad_norm_` and `torch.optim.Adam`). On CPU it
  also needs the wrap to see a CUDA device index (the CPU layer's `current_device()` is a CPU
  device: "Invalid device string: 'cuda:cpu'") and `gradient_reduce_div_fusion=False` (gloo has
  no PREMUL_SUM); both are pinned. With tensor parallelism the wrap also gathers tensor
  metadata over the whole world (torch's `DTensor.from_local(run_check=True)`), pinned from
  the source. Nothing is faked but the device index the wrap sees.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import traceback

import pytest
import torch
from packaging.version import Version

from tests.harness.ranks import spawn

MEGATRON_CORE = Version(importlib.metadata.version("megatron-core"))
ON_0_16 = pytest.mark.skipif(
    MEGATRON_CORE.release[:2] != (0, 16),
    reason=f"pins megatron-core 0.16.x; {MEGATRON_CORE} is installed",
)
ON_0_19 = pytest.mark.skipif(
    MEGATRON_CORE.release[:2] != (0, 19),
    reason=f"pins megatron-core 0.19.x; {MEGATRON_CORE} is installed",
)
KNOWN = pytest.mark.skipif(
    MEGATRON_CORE.release[:2] not in ((0, 16), (0, 19)),
    reason=f"measured on megatron-core 0.16.x and 0.19.x; {MEGATRON_CORE} is installed",
)
LR, CLIP, SEQ = 1e-3, 1.0, 8


@ON_0_16
def test_the_0_16_adapter_reads_the_global_tensor_parallel_group():
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    assert parallel_state.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        FullyShardedDataParallel._fix_tensor_parallel_attributes(None, torch.nn.Linear(2, 2))


def _carve(world_size: int, num_train_ranks: int, train_args: dict | None = None):
    """The world's groups: a generate window (rank 0, an engine host) then a train window."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.recipe.schema import RoleGroupSpec

    specs = [RoleGroupSpec(roles=["generate"], num_ranks=world_size - num_train_ranks),
             RoleGroupSpec(roles=["train"], num_ranks=num_train_ranks)]  # fmt: skip
    par = Parallelism.from_megatron_args(train_args or {})
    return build_world_groups(plan_layout(world_size, specs, {"train": par}), "gloo")


def _fsdp_config(**overrides):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy="optim_grads_params", **overrides,
    )  # fmt: skip


def _wrap(config, chunk, pgc, ddp_config=None, cuda_index: bool = True):
    """megatron-core's adapter around `chunk` over the role's groups, on the CPU. `cuda_index`:
    `torch.cuda.current_device()` answers 0 during the wrap, as on a GPU (the adapter and
    `MegatronFSDP` build "cuda:<index>" from it; the CPU layer answers a CPU device)."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    current_device = torch.cuda.current_device
    if cuda_index:
        torch.cuda.current_device = lambda: 0
    try:
        return FullyShardedDataParallel(
            config, ddp_config or _fsdp_config(), chunk, device=torch.device("cpu"),
            pg_collection=pgc,
        )  # fmt: skip
    finally:
        torch.cuda.current_device = current_device


def _failure(fn) -> tuple[str, list[str]] | None:
    """`fn()`'s exception as "Type: message" and the functions it was raised through."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the type is einops', torch's or an assertion
        functions = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
        return f"{type(error).__name__}: {error}", functions
    return None


def _one_rank_role(rank, world_size, tmp_dir):
    from megatron.core.transformer.transformer_config import TransformerConfig

    role = _carve(world_size, 1).roles["train"]
    if not role.is_member:
        return None
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    return _failure(lambda: _wrap(config, torch.nn.Linear(2, 2), role.pg_collection))


@KNOWN
def test_the_adapter_meshes_the_whole_world(tmp_path):
    """A 1-rank role (rank 1) in a 2-rank world: the mesh wants 2 ranks where the role has 1."""
    engine, (message, functions) = spawn(_one_rank_role, 2, tmp_path)
    assert engine is None
    assert "_get_dp_tp_mesh" in functions and "_init_dist_index" in functions, functions
    assert message.startswith("EinopsError") and "Shape mismatch, 2 != 1" in message, message


def _role_mesh(dp_cp_group, tp_group, ep_size=1):
    """This rank's dp_cp x tp block of its role grid, from the two groups alone: a grid's rank
    is affine in its coordinates, so the rank at (dp i, tp j) is dp[i] + tp[j] - this rank."""
    import torch.distributed as dist

    me = dist.get_rank()
    dp, tp = (dist.get_process_group_ranks(group) for group in (dp_cp_group, tp_group))
    return torch.tensor([[d + t - me for t in tp] for d in dp])


def _tokens(step: int, dp_rank: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * step + dp_rank)
    return torch.randint(0, vocab, (2, SEQ), generator=generator)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(SEQ).expand_as(tokens)
    return model(input_ids=tokens, position_ids=positions, attention_mask=None)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return _logits(model, tokens).float().pow(2).mean()


def _two_rank_role(rank, world_size, tmp_dir, path):
    """A 2-rank train role at offset 1 in a 3-rank world (rank 0: generate)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    from megatron_async_rl.distributed.layout import Parallelism
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.models import builder
    from tests.harness.roles import role_args

    args = role_args(path)
    role = _carve(world_size, 2, args).roles["train"]
    if not role.is_member:
        return None
    pgc, par = role.pg_collection, Parallelism.from_megatron_args(args)
    config = builder.build_transformer_config(args, par, detect_platform("cpu", "gloo"))
    spec = builder.model_spec(args, par, detect_platform("cpu", "gloo"))

    def chunk():  # the same weights every time (the builder seeds its generators)
        return builder.build_gpt_chunks(config, spec, pgc, 5, torch.device("cpu"))[0]

    out = {"global_tp": parallel_state.get_tensor_model_parallel_group(check_initialized=False)}
    out["upstream_mesh"] = _failure(lambda: _wrap(config, chunk(), pgc))
    mcore_fsdp_adapter._get_dp_tp_mesh = _role_mesh
    out["cpu_device"] = _failure(lambda: _wrap(config, chunk(), pgc, cuda_index=False))
    fused = _wrap(config, chunk(), pgc)
    out["div_fusion"] = _failure(lambda: _loss(fused, _tokens(0, 0, spec.vocab_size)).backward())
    model = _wrap(config, chunk(), pgc, _fsdp_config(gradient_reduce_div_fusion=False))
    out["mesh"] = model.megatron_fsdp_dist_index.device_mesh.mesh.tolist()
    out["dtensors"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
    return {**out, **_steps_against_torch(model, chunk(), pgc, spec.vocab_size)}


def _steps_against_torch(model, twin, pgc, vocab: int) -> dict:
    """Two steps of megatron-core's distributed optimizer on `model`, and of torch's Adam on
    `twin` (the same weights) over every data-parallel rank's batch."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_async_rl.roles.megatron_wrap import role_scoped_object_gather

    config = OptimizerConfig(optimizer="adam", lr=LR, clip_grad=CLIP, weight_decay=0.0,
                             use_distributed_optimizer=True)  # fmt: skip
    with role_scoped_object_gather(pgc.intra_dist_opt):
        optimizer = get_megatron_optimizer(config, [model], use_gloo_process_groups=False,
                                           pg_collection=pgc)  # fmt: skip
    reference = torch.optim.Adam(twin.parameters(), lr=LR)
    dp_size, dp_rank = pgc.dp_cp.size(), dist.get_rank(pgc.dp_cp)
    probe = _tokens(9, 0, vocab)
    with torch.no_grad():
        before = _logits(twin, probe)
    out = {"norms": [], "reference_norms": []}
    for step in range(2):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _loss(model, _tokens(step, dp_rank, vocab)).backward()
        model.finish_grad_sync()
        out["norms"].append(float(optimizer.step()[1]))
        reference.zero_grad()
        losses = [_loss(twin, _tokens(step, r, vocab)) for r in range(dp_size)]
        (sum(losses) / dp_size).backward()
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), CLIP)
        out["reference_norms"].append(float(norm))
        reference.step()
    with torch.no_grad():
        after, got = _logits(twin, probe), _logits(model, probe)
    out["moved"] = (after - before).abs().max().item()
    out["logits_diff"] = (got - after).abs().max().item()
    return out


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model("llama", tie_word_embeddings=False))


@ON_0_19
def test_the_0_19_adapter_takes_the_role_groups_but_meshes_the_whole_world(tiny_path, tmp_path):
    engine, *roles = spawn(_two_rank_role, 3, tmp_path, tiny_path)
    assert engine is None
    for out in roles:
        assert out["global_tp"] is None  # never initialised, never needed
        message, functions = out["upstream_mesh"]
        assert "_get_dp_tp_mesh" in functions and "Shape mismatch, 3 != 2" in message, message
        assert "Invalid device string: 'cuda:cpu'" in out["cpu_device"][0]
        assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in out["div_fusion"][0]
        assert out["mesh"] == [[1], [2]] and out["dtensors"]
        assert out["norms"] == pytest.approx(out["reference_norms"], rel=1e-6)
        assert out["moved"] > 1e-2 and out["logits_diff"] <= 1e-5, out


@ON_0_19
def test_the_0_19_tensor_parallel_wrap_gathers_over_the_whole_world():
    """`make_fsdp_dtensor` builds a tensor-parallel parameter with `DTensor.from_local(...,
    run_check=run_check)`, True from `_init_distributed_params`, and torch's check gathers
    every rank's metadata over the default group: engine ranks would have to join it."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers
    from torch.distributed.tensor import _collective_utils

    assert "run_check=True" in inspect.getsource(
        buffers.ParamAndGradBuffer._init_distributed_params
    )
    assert "run_check=run_check" in inspect.getsource(buffers.make_fsdp_dtensor)
    check = inspect.getsource(_collective_utils.check_tensor_meta)
    assert "all_gather_object(gathered_metadata, local_metadata)" in check, "revisit the refusal"
