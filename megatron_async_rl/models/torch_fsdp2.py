"""A trained role's model chunks under torch's FSDP2 (--use-torch-fsdp2), and full tensors of them.

Owned here: `wrap_chunks` (megatron-core's `TorchFullyShardedDataParallel` around each model
chunk, as Megatron-LM's `get_model` builds it for --use-torch-fsdp2, with
--torch-fsdp2-no-reshard-after-forward), and how every weight reader and writer reaches a
parameter that FSDP2 has made a DTensor sharded over the role's data-parallel ranks:
`full_tensor` (the whole tensor; a collective over those ranks), `copy_full_into` (a whole
tensor into this rank's shard; no communication), and for checkpoints, which hold the shards,
`check_even_shards`, `shard_loaded_state` and `shard_optimizer_state` (loaded shards back into
DTensors). Called by `roles.megatron_role` (wrapping), `models.weights` (HF load and export),
`weight_sync.broadcast` (the train role's tensors) and `checkpoint.megatron_state`.

The parameters stay sharded between steps: a reader gathers one tensor at a time, and every
data-parallel rank of the role must read the same tensors in the same order (they do: they walk
the same model). Which flags go with FSDP2 is `config.megatron.rules`' `_torch_fsdp2_rules`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_async_rl.config.errors import warn_once
from megatron_async_rl.config.megatron import core_kwargs


def _modules_to_shard(use_te: bool) -> set:
    """The submodules each of which is its own FSDP unit (megatron-core's default set).

    Without Transformer Engine the layers' own linears are megatron-core's
    `ColumnParallelLinear` too, nested inside the `TransformerLayer` units: megatron-core drops
    that class only when `transformer_impl` is "local", which the config here leaves at its
    default while the local spec is built (sharding a linear twice fails in `fully_shard`)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    modules = {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding}
    if use_te:  # the output layer, the only ColumnParallelLinear of a TE model
        modules.add(tensor_parallel.ColumnParallelLinear)
    return modules


def wrap_chunks(chunks: list, config, args: dict[str, Any], use_te: bool, dp_group) -> list:
    """Each chunk in megatron-core's `TorchFullyShardedDataParallel`, sharded over `dp_group`
    (the role's data- and context-parallel ranks, as Megatron-LM's default group). As in
    Megatron-LM, the DDP settings do not apply: a non-default one is named in a warning."""
    from megatron.core.distributed import (
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
    )

    dtypes: dict = {}  # dtype -> the first parameter of it
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            dtypes.setdefault(param.dtype, name)
    if len(dtypes) > 1:
        raise ValueError(
            "--use-torch-fsdp2: FSDP2 shards the parameters of a unit in one dtype, and this "
            "model mixes " + ", ".join(f"{d} ({n})" for d, n in dtypes.items()) + " (with "
            "--bf16, megatron-core's local layer spec, used without Transformer Engine, keeps "
            "its norms in fp32); drop --bf16, or --use-torch-fsdp2"
        )
    defaults = DistributedDataParallelConfig()
    ignored = sorted(
        name for name, value in core_kwargs.ddp_config_kwargs(args).items()
        if value != getattr(defaults, name)
    ) + (["ddp_num_buckets"] if args.get("ddp_num_buckets") else [])  # fmt: skip
    if ignored:
        warn_once(
            f"--use-torch-fsdp2: the DDP settings {', '.join(ignored)} are ignored (FSDP2 "
            "reduce-scatters each unit's gradients itself, as in Megatron-LM)"
        )
    fsdp_config = TorchFullyShardedDataParallelConfig(
        reshard_after_forward=bool(args.get("torch_fsdp2_reshard_after_forward", True))
    )
    modules = _modules_to_shard(use_te)
    return [
        TorchFullyShardedDataParallel(
            config, fsdp_config, chunk, sub_modules_to_wrap=modules, process_group=dp_group
        )
        for chunk in chunks
    ]


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 parameter (all-gathered over its data-parallel ranks, each
    of which must ask for it too), or `tensor` itself when it is not sharded."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


@torch.no_grad()
def copy_full_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the whole tensor `source` into `target`: into this rank's shard of it when `target`
    is an FSDP2 parameter (each rank cuts its shard from its own `source`: no communication)."""
    if is_sharded(target):
        from torch.distributed.tensor import distribute_tensor

        source = distribute_tensor(
            source.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
    target.copy_(source)


def shard_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`value`, this rank's shard of the FSDP2 parameter `target` (as a checkpoint load gives
    it), as a DTensor laid out like `target`; `value` itself when `target` is not sharded."""
    if not is_sharded(target) or is_sharded(value):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value, target.device_mesh, target.placements, run_check=False, shape=target.shape,
        stride=target.stride(),
    )  # fmt: skip


def shard_loaded_state(module, loaded: dict) -> dict:
    """`loaded` (a checkpoint's state dict of `module`, each FSDP2 parameter as this rank's
    shard) ready for `module.load_state_dict`: those shards as DTensors like the parameters."""
    own = module.state_dict(keep_vars=True)
    return {name: shard_like(value, own[name]) if name in own else value
            for name, value in loaded.items()}  # fmt: skip


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict`: each state tensor loaded as this rank's shard of an
    FSDP2 parameter (torch's loader casts it to a plain tensor) becomes a DTensor like it."""
    for param, state in optimizer.state.items():
        if not is_sharded(param):
            continue
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == param.to_local().shape and key != "step":
                state[key] = shard_like(value, param)


def sharded(chunks: list) -> bool:
    """Whether the model chunks are under FSDP2 (their parameters sharded DTensors)."""
    return any(is_sharded(p) for chunk in chunks for p in chunk.parameters())


def check_even_shards(chunks: list, role: str) -> None:
    """megatron-core's checkpoint of an FSDP2 parameter gives each data-parallel rank the same
    share of dim 0 (`make_sharded_tensor_for_checkpoint`); FSDP2 cuts it as `torch.chunk` does,
    unevenly when dim 0 is not a multiple of the ranks: refused before anything is written."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            ranks = param.device_mesh.size() if is_sharded(param) else 1
            if param.shape[0] % ranks:
                raise ValueError(
                    f"--use-torch-fsdp2: role {role}'s parameter {name} (dim 0 of size "
                    f"{param.shape[0]}) does not split evenly over its {ranks} data-parallel "
                    "ranks, and megatron-core 0.16.1 checkpoints only even FSDP2 shards; use "
                    "a data-parallel size that divides it"
                )
