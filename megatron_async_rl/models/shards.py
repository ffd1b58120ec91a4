"""Tensor-parallel shards of Megatron parameters, and the state dict each rank holds.

Owned here: cutting a full Megatron tensor into the slice one TP (or expert-TP) rank holds and
gathering the slices back (`shard_for_rank`, `unshard`, by the `names.ShardSpec` of each
parameter); what one rank of a (tp, pp, ep, etp, vp) grid holds, parameter by parameter
(`stage_entries`), built from a full Megatron state dict (`stage_state_dict`) or read from a HF
checkpoint a parameter at a time (`stage_state_dict_from_hf`, `build_shard`); and a rank's own
tensors by name (`rank_state_dict`). Called by HF loading and export (`models.weights`) and
weight sync (`weight_sync`). The top of `dims` -> `names` -> `shards`. Pure torch: no
`torch.distributed`, no megatron.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_async_rl.models.dims import ModelDims, expert_offset, hf_shape
from megatron_async_rl.models.names import (
    MTP_LAYER_RE,
    ShardSpec,
    chunk_name,
    hf_names_for,
    hf_to_megatron_param,
    mtp_canonical_name,
    param_rule,
    shard_spec,
    stage_param_names,
    to_local_name,
)

MTP_PREFIX = "mtp."
"""The multi-token-prediction layers' names in a GPTModel's state dict (--mtp-num-layers)."""


def rank_state_dict(chunks, mtp_num_layers: int = 0) -> dict[str, Tensor]:
    """A rank's tensors by the names `chunk_name` gives them, from its model chunks (a list of
    modules, or one object with `state_dict()`; MTP names as `mtp_canonical_name` spells them,
    on every megatron-core release); `_extra_state` entries left out, and so are
    the MTP layers (`MTP_PREFIX`) from `mtp_num_layers` on: HF loading and export pass the
    layers with HF names (`ModelDims.hf_mtp_layers`, fewer when a checkpoint lacks some), the
    others leave them as initialised (HF load) or out (export); weight sync passes none, the
    engines run no speculative decoding. All are trained, and saved and restored with the
    role's Megatron checkpoints (`checkpoint.megatron_state`, from the sharded state dicts).
    Left out too: the copy of the word embedding that the MTP layers' stage holds with
    pipeline stages (`mtp_embedding_copy`: the first stage's tensor, tied to it by
    megatron-core)."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    return {
        chunk_name(mtp_canonical_name(k), v, len(chunks)): t
        for v, chunk in enumerate(chunks)
        for k, t in chunk.state_dict().items()
        if not k.endswith("._extra_state")
        and _kept(k, mtp_num_layers)
        and not (k == EMBEDDING and mtp_embedding_copy(chunk) is not None)
    }


EMBEDDING = "embedding.word_embeddings.weight"


def mtp_embedding_copy(chunk) -> Tensor | None:
    """The copy of the word embedding a model chunk holds for its MTP layers on a stage other
    than the first (megatron-core's `GPTModel` with `mtp_process` and not `pre_process`, tied to
    the first stage's through the `embd` group), else None."""
    if getattr(chunk, "mtp_process", False) and not getattr(chunk, "pre_process", True):
        return chunk.embedding.word_embeddings.weight
    return None


def _kept(name: str, mtp_num_layers: int) -> bool:
    """Whether `rank_state_dict` keeps a state-dict name: outside MTP, or of an MTP layer below
    `mtp_num_layers`."""
    if not name.startswith(MTP_PREFIX):
        return True
    m = MTP_LAYER_RE.match(name)
    return bool(m) and int(m.group(1)) < mtp_num_layers


def shard_for_rank(full: Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> Tensor:
    """Exactly the slice TP rank `tp_rank` holds (expert-TP rank for experts)."""
    if spec.partition_dim is None or tp_size == 1:
        return full
    dim, size = spec.partition_dim, full.shape[spec.partition_dim]
    if size % (tp_size * spec.stride):
        hint = " (pad the vocab with pad_vocab first)" if spec.is_vocab else ""
        raise ValueError(
            f"dim {dim} of size {size} does not split into tp_size={tp_size} x "
            f"stride={spec.stride}{hint}"
        )
    parts = [c.chunk(tp_size, dim=dim)[tp_rank] for c in full.chunk(spec.stride, dim=dim)]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def unshard(shards: list[Tensor], spec: ShardSpec) -> Tensor:
    """Inverse of `shard_for_rank` over all ranks (shards in TP-rank order)."""
    if spec.partition_dim is None or len(shards) == 1:
        return shards[0]
    dim = spec.partition_dim
    pieces = [s.chunk(spec.stride, dim=dim) for s in shards]
    return torch.cat([p[k] for k in range(spec.stride) for p in pieces], dim=dim)


def stage_state_dict(
    full_sd: Mapping[str, Tensor],
    dims: ModelDims,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> dict[str, Tensor]:
    """What one rank loads: local names, its TP (or expert-TP) slices, from a full state dict.

    The tied `output_layer.weight` of the last stage (PP>1) is read from the embedding. Expert-TP
    defaults to TP, as megatron-core's `expert_tensor_parallel_size` does.
    """
    return _stage(
        full_sd.__getitem__, dims, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
        pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size, etp_rank=etp_rank, etp_size=etp_size,
    )  # fmt: skip


def stage_state_dict_from_hf(
    read: Callable[[str], Tensor],
    dims: ModelDims,
    read_range: Callable[[str, int, int, int], Tensor] | None = None,
    **ranks,
) -> dict:
    """`stage_state_dict` of the Megatron form of a HF checkpoint, reading through `read(hf
    name)` only the HF tensors this rank's parameters come from (its stage's layers, its
    experts), one parameter at a time; `ranks` as `stage_state_dict`'s. With
    `read_range(hf name, dim, start, stop)` a TP-split parameter reads only the rank's rows or
    columns of its sources (a TP rank then reads about 1/TP of them)."""

    return {
        e.local: _owned(build_shard(e, dims, read, read_range))
        for e in stage_entries(dims, **ranks)
    }


def _rank_param(name, spec: ShardSpec, rank: int, size: int, dims: ModelDims, read_range):
    """TP rank `rank`'s slice of a split parameter, from the matching slices of its sources
    (equal to `shard_for_rank` of the whole parameter, tested)."""
    sources, kind, _ = param_rule(name, dims)
    dim = spec.partition_dim

    def chunk(hf: str, length: int) -> Tensor:
        if length % size:
            raise ValueError(f"{hf}: dim {dim} of size {length} does not split over TP {size}")
        step = length // size
        return read_range(hf, dim, rank * step, (rank + 1) * step)

    if kind == "vocab":
        padded = dims.padded_vocab_size or dims.vocab_size
        step = padded // size
        start, stop = rank * step, (rank + 1) * step
        rows = read_range(sources[0], 0, min(start, dims.vocab_size), min(stop, dims.vocab_size))
        pad = rows.new_zeros(step - rows.shape[0], *rows.shape[1:])
        return torch.cat([rows, pad]) if pad.shape[0] else rows
    parts = [chunk(h, hf_shape(h, dims)[dim]) for h in sources]
    if kind == "copy":
        return parts[0]
    if kind == "glu":  # [gate_r; up_r], what stride 2 gives
        return torch.cat(parts, dim=0)
    local = dataclasses.replace(
        dims, num_query_groups=dims.num_query_groups // size,
        num_attention_heads=dims.num_attention_heads // size,
    )  # fmt: skip
    return hf_to_megatron_param(name, parts, local)



@dataclass(frozen=True)
class StageEntry:
    """One parameter a rank holds: its local name, the global parameter it is sliced from
    (the embedding for a tied `output_layer.weight`), and the slice (`rank` of `size`)."""

    local: str
    source: str
    spec: ShardSpec
    rank: int
    size: int


def stage_entries(
    dims: ModelDims, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, ep_rank=0, ep_size=1,
    etp_rank=None, etp_size=None,
) -> list[StageEntry]:  # fmt: skip
    """What one rank holds, parameter by parameter (keyword arguments as `stage_state_dict`),
    named as `rank_state_dict` names them (every model chunk of the rank)."""
    etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank or 0, etp_size)
    e0 = expert_offset(ep_rank, ep_size, dims.num_experts) if dims.num_experts else 0
    chunks = dims.chunks(pp_size)
    out = []
    for v in chunks:
        vp_stage = v if len(chunks) > 1 else None
        l0 = dims.stage_layers(pp_rank, pp_size, vp_stage).start
        for name in stage_param_names(
            dims, pp_rank=pp_rank, pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size,
            vp_stage=vp_stage,
        ):  # fmt: skip
            source = name
            if name == "output_layer.weight" and dims.tied_embeddings:
                source = "embedding.word_embeddings.weight"
            spec = shard_spec(name, dims)
            rank, size = (etp_rank, etp_size) if spec.is_expert else (tp_rank, tp_size)
            local = to_local_name(name, layer_offset=l0, expert_offset=e0)
            out.append(StageEntry(chunk_name(local, v, len(chunks)), source, spec, rank, size))
    return out


def build_shard(
    entry: StageEntry, dims: ModelDims, read: Callable[[str], Tensor], read_range=None
) -> Tensor:
    """`entry`'s slice from HF tensors: `read(hf name)` gives one whole, `read_range(hf name,
    dim, start, stop)` (optional) a TP-split parameter's rows or columns only."""
    if read_range is not None and entry.spec.partition_dim is not None and entry.size > 1:
        return _rank_param(entry.source, entry.spec, entry.rank, entry.size, dims, read_range)
    sources = [read(h) for h in hf_names_for(entry.source, dims)]
    whole = hf_to_megatron_param(entry.source, sources, dims)
    return shard_for_rank(whole, entry.spec, entry.rank, entry.size)


def _stage(full: Callable[[str], Tensor], dims: ModelDims, **ranks) -> dict[str, Tensor]:
    """The rank's local slices; `full(global Megatron name)` gives a whole parameter."""
    return {
        e.local: _owned(shard_for_rank(full(e.source), e.spec, e.rank, e.size))
        for e in stage_entries(dims, **ranks)
    }


def _owned(shard: Tensor) -> Tensor:
    """`shard`, cloned when it is a view of a larger tensor (do not keep the whole alive)."""
    return shard.clone() if shard.untyped_storage().nbytes() > shard.nbytes else shard
