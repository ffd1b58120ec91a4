"""Move weights between a role's Megatron model stage and HuggingFace safetensors.

Owned here: loading a HF checkpoint into this rank's shard (`load_hf_into_megatron`) and gathering
a role's sharded model back into one HF state dict (`gather_hf_state_dict`) for export and checks.
Names and split rules come from `models.names` (one source of truth, shared with weight sync).
Called by `roles.megatron_role` and the export path of the entry point. A model with a scalar
head (`spec.head`, `models.heads`) loads and exports it as HF `score.*`; loading a checkpoint
without one (a policy's, into a critic) initialises it (`head_init_std`). Multi-token-prediction
layers (--mtp-num-layers) load and export where the HF format names them (DeepSeek-V3's:
`models.names`, `ModelDims.hf_mtp_layers`); weight sync leaves them out (`weight_sync.broadcast`).
With pipeline stages their stage's copy of the word embedding loads from the HF embedding and
is neither exported nor synced (the first stage's is).

The gather here is the simple, whole-model one (every tensor through the role's first rank); the
planned, bucketed, bounded-memory reshard for weight sync lives in `weight_sync/`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_async_rl.distributed import devices
from megatron_async_rl.models import heads, hf_checkpoint, torch_fsdp2
from megatron_async_rl.models.dims import ModelDims, expert_offset
from megatron_async_rl.models.names import (
    check_hf_names,
    megatron_to_hf,
    mtp_layers_in,
    rank_global_name,
    shard_spec,
)
from megatron_async_rl.models.shards import (
    EMBEDDING,
    StageEntry,
    build_shard,
    mtp_embedding_copy,
    rank_state_dict,
    stage_state_dict_from_hf,
    unshard,
)


def model_dims(args: dict[str, Any], spec, *, mtp: bool = True) -> ModelDims:
    """`ModelDims` of a role's model, its MTP layers included unless `mtp` is False (weight
    sync's view: the engines run no speculative decoding; `spec` is a `builder.ModelSpec`; with
    a head, its embeddings are untied whatever the flags say, as the builder makes them)."""
    merged = dict(args)
    merged.update(
        vocab_size=spec.vocab_size,
        padded_vocab_size=spec.padded_vocab_size,
        transformer_impl="transformer_engine" if spec.use_te else "local",
    )
    head = getattr(spec, "head", None)
    if head is not None:
        merged["untie_embeddings_and_output_weights"] = True
    dims = ModelDims.from_megatron_args(merged)
    mtp_num_layers = int(args.get("mtp_num_layers") or 0) if mtp else 0
    return dataclasses.replace(dims, head=head, mtp_num_layers=mtp_num_layers)


def stage_ranks(pgc) -> dict[str, int]:
    """This rank's place in its role grid, as `shards.stage_entries` takes it."""
    return {
        "tp_rank": dist.get_rank(pgc.tp),
        "tp_size": dist.get_world_size(pgc.tp),
        "pp_rank": dist.get_rank(pgc.pp),
        "pp_size": dist.get_world_size(pgc.pp),
        "ep_rank": dist.get_rank(pgc.ep),
        "ep_size": dist.get_world_size(pgc.ep),
        "etp_rank": dist.get_rank(pgc.expt_tp),
        "etp_size": dist.get_world_size(pgc.expt_tp),
    }


@torch.no_grad()
def load_hf_into_megatron(
    chunks, path: str, args: dict[str, Any], pgc, spec, *, head_init_std: float | None = None,
    head_seed: int = 0,
) -> tuple[int, int]:  # fmt: skip
    """Copy this rank's slice of every parameter of the HF checkpoint at `path` into its model
    `chunks` (a list, or one module), reading only what this rank's parameters come from: its
    pipeline stage's layers, its experts, and of TP-split tensors its rows or columns. Returns
    the bytes read and the number of MTP layers loaded (from 0 on: those with HF names that the
    checkpoint carries, `mtp_layers_in`; the model's others keep their initialisation).

    With a scalar head (`spec.head`), head tensors the checkpoint lacks are initialised when
    `head_init_std` is given (`heads.head_reader`: N(0, std^2) from `head_seed`, 0: zeros)."""
    dims = model_dims(args, spec)
    reader = hf_checkpoint.HFTensorReader(path)
    read, names = reader.read, reader.keys()
    if dims.head is not None:
        read, names = heads.head_reader(read, names, dims, head_init_std, head_seed, path)
    elif head_init_std is not None:
        raise ValueError(f"head_init_std={head_init_std}: this model has no scalar head")
    dims = dataclasses.replace(dims, mtp_num_layers=mtp_layers_in(names, dims))
    check_hf_names(names, dims)
    ranks = stage_ranks(pgc)
    local = stage_state_dict_from_hf(read, dims, reader.read_range, **ranks)
    _copy_into(chunks, local, path, dims.hf_mtp_layers)
    _fill_mtp_embedding_copies(chunks, dims, reader, ranks)
    return reader.bytes_read, dims.hf_mtp_layers


def _fill_mtp_embedding_copies(chunks, dims: ModelDims, reader, ranks: dict) -> None:
    """The MTP stage's copies of the word embedding (`mtp_embedding_copy`, pipeline
    stages only) get this rank's slice of the checkpoint's embedding: equal to the first
    stage's, as megatron-core keeps them (its all-reduce of their gradients)."""
    for chunk in chunks if isinstance(chunks, (list, tuple)) else [chunks]:
        target = mtp_embedding_copy(chunk)
        if target is None:
            continue
        name = EMBEDDING
        entry = StageEntry(
            name, name, shard_spec(name, dims), ranks["tp_rank"], ranks["tp_size"]
        )
        source = build_shard(entry, dims, reader.read, reader.read_range)
        torch_fsdp2.copy_full_into(target, source)


@torch.no_grad()
def load_hf_state_dict_into_megatron(
    chunks, hf_sd: dict, args: dict[str, Any], pgc, spec, path: str = "<in memory>"
) -> None:
    """Copy this rank's slice of every tensor of a full HF state dict into its model `chunks`
    (cut from the HF tensors directly: no whole-model conversion). Weight sync's (into the
    logp role): MTP layers are neither sent nor loaded."""
    dims = model_dims(args, spec, mtp=False)

    def read_range(name: str, dim: int, start: int, stop: int):
        return hf_sd[name].narrow(dim, start, stop - start)

    local = stage_state_dict_from_hf(
        hf_sd.__getitem__, dims, read_range, **stage_ranks(pgc)
    )
    _copy_into(chunks, local, path)


def _copy_into(chunks, local: dict, path: str, mtp_num_layers: int = 0) -> None:
    """Copy the rank's local slices into its chunks' parameters (those of MTP layers below
    `mtp_num_layers` included); every one must match."""
    own = rank_state_dict(chunks, mtp_num_layers)
    missing, unexpected = sorted(own.keys() - local.keys()), sorted(local.keys() - own.keys())
    if missing or unexpected:
        raise RuntimeError(
            f"HF checkpoint {path} does not match the model stage on global rank "
            f"{dist.get_rank()}: parameters without a source {missing[:6]}, sources without a "
            f"parameter {unexpected[:6]}"
        )
    for name, target in own.items():
        source = local[name]
        if source.shape != target.shape:
            raise RuntimeError(
                f"HF checkpoint {path}: parameter {name} on global rank {dist.get_rank()} has "
                f"shape {tuple(target.shape)} but the checkpoint gives {tuple(source.shape)}"
            )
        torch_fsdp2.copy_full_into(target, source)


def full_rank_state_dict(chunks, mtp_num_layers: int = 0) -> dict[str, torch.Tensor]:
    """`rank_state_dict` with whole tensors where FSDP2 shards them over the role's
    data-parallel ranks (--use-torch-fsdp2): collective over those ranks then, each of which
    must call it (one tensor gathered at a time, while the dict is built)."""
    return {
        name: torch_fsdp2.full_tensor(tensor)
        for name, tensor in rank_state_dict(chunks, mtp_num_layers).items()
    }


@torch.no_grad()
def gather_megatron_state_dict(chunks, args: dict[str, Any], pgc, spec):
    """The full, global-named Megatron state dict on the role's first rank; None elsewhere.
    `chunks`: the rank's model chunks (a list, or one module).

    Collective over the role (every rank of its window must call it).
    """
    dims = model_dims(args, spec)
    ranks = stage_ranks(pgc)
    e0 = (
        expert_offset(ranks["ep_rank"], ranks["ep_size"], dims.num_experts)
        if dims.num_experts
        else 0
    )
    # One copy of each tensor goes to the role's first rank: replicas send nothing. Dense tensors
    # come from (dp 0, tp 0), expert tensors from (expert-dp 0, expert-tp 0) of each EP rank.
    dense_sender = dist.get_rank(pgc.dp) == 0 and ranks["tp_rank"] == 0
    expert_sender = dist.get_rank(pgc.expt_dp) == 0 and ranks["etp_rank"] == 0
    gathered: dict[str, torch.Tensor] = {}
    for local_name, tensor in full_rank_state_dict(chunks, dims.hf_mtp_layers).items():
        name = rank_global_name(
            local_name, dims, pp_rank=ranks["pp_rank"], pp_size=ranks["pp_size"], expert_offset=e0
        )
        spec_ = shard_spec(name, dims)
        group = pgc.expt_tp if spec_.is_expert else pgc.tp
        if spec_.partition_dim is not None and dist.get_world_size(group) > 1:
            shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, tensor.contiguous(), group=group)
            tensor = unshard(shards, spec_)
        if expert_sender if spec_.is_expert else dense_sender:
            gathered[name] = tensor.detach().clone()
    role_group = pgc.intra_dist_opt
    parts = [None] * dist.get_world_size(role_group)
    devices.gather_object(
        gathered,
        parts if dist.get_rank(role_group) == 0 else None,
        dst=dist.get_global_rank(role_group, 0),
        group=role_group,
    )
    if dist.get_rank(role_group) != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        if part:
            merged.update(part)
    if dims.tied_embeddings:
        merged.pop("output_layer.weight", None)  # the last stage's copy of the embedding
    return merged


def gather_hf_state_dict(chunks, args: dict[str, Any], pgc, spec):
    """`gather_megatron_state_dict` converted to HF names (on the role's first rank)."""
    merged = gather_megatron_state_dict(chunks, args, pgc, spec)
    if merged is None:
        return None
    return megatron_to_hf(merged, model_dims(args, spec))
