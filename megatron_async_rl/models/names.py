"""Names and layouts between Megatron-core GPT (0.16.1) and HF llama/qwen2/qwen3(_moe)/deepseek_v3.

The single source of truth for which HF tensors a Megatron parameter becomes (and back), the
tensor-parallel split of each (`ShardSpec`, applied by `models.shards`), and how stage-local
layer / expert indices and model chunks map to global names. Called by HF loading and export
(`hf_to_megatron`, `megatron_to_hf`), sharded loading (`models.shards`) and weight sync
(`shard_spec`, `megatron_param_to_hf`, `to_global_name`). Sizes come from `models.dims`. Pure
torch: no `torch.distributed`, no megatron.

Megatron layouts (read from megatron-core 0.16.1, logits-checked by the lead):
- `linear_qkv` rows are interleaved per query group g: `[q heads of g (nq/ng of them); k_g; v_g]`
  (`Attention.get_query_key_value_tensors` views `[.., ng, (nq/ng + 2) * d]`), and query head
  `g * nq/ng + i` uses kv head g, the same grouping as HF `repeat_kv`. TP splits the rows evenly,
  i.e. whole query groups when ng >= tp; when ng < tp Megatron all-gathers inside attention, and
  the stored slice is still an even row block, so stride 1 is right in both cases.
- SwiGLU `linear_fc1` is `[gate; up]` (`glu` takes `chunk(2)[0]` as gate). A column-parallel
  rank holds `[gate_r; up_r]`: partition stride 2, so a plain concat of shards is wrong.
- `linear_proj` / `linear_fc2` split dim 1; embedding and `output_layer` dim 0 over the padded
  vocab (`pad_vocab`); norms and the router are replicated. Experts use the expert-TP size.
- With the Transformer Engine spec the pre-attention norm is `linear_qkv.layer_norm_weight` and,
  for a dense MLP, the pre-MLP norm is `linear_fc1.layer_norm_weight`; MoE keeps
  `pre_mlp_layernorm`. Both spellings are parsed; `ModelDims.te_fused_norms` picks the one
  produced. Experts are SequentialMLP's `experts.local_experts.{j}` (`moe_grouped_gemm=False`);
  TE grouped-GEMM names (`experts.linear_fc1.weight{j}`) are not handled yet.
- Multi-latent attention (deepseek_v3; `hf_deepseek` has the numerics): each HF tensor is one
  Megatron parameter, in the same row order. TP splits `linear_q_proj`/`linear_q_up_proj`/
  `linear_kv_up_proj` rows by head and `linear_proj` columns; the local spec also splits the
  down projections' rows (column-parallel, gathered in the forward), the TE spec keeps them whole
  ('duplicated'), and fuses `q_layernorm`/`kv_layernorm` into the up projections.
- Mixed stacks (`--moe-layer-freq` as a list: dense first layers) have dense MLP names on dense
  layers and MoE names on MoE layers; shared experts (`mlp.shared_experts.linear_fc1/2`) split
  as a dense MLP over TP, and the router's `expert_bias` buffer is HF's `e_score_correction_bias`.
- A scalar head (`ModelDims.head`, `models.heads`) in place of the LM head: Megatron's
  `output_layer.weight` [1, hidden] (and, for a value head, `output_layer.bias` [1]) is HF's
  `score.weight` (`score.bias`) of `*ForSequenceClassification` (`*ForTokenClassification`),
  replicated over TP; a head model has untied embeddings, and a policy checkpoint's `lm_head`
  is ignored when loading one.
- Virtual pipeline stages (`ModelDims.vp_size` V > 1): a rank holds V model chunks, chunk v of
  pipeline rank p the layers of virtual stage v x pp + p (`ModelDims.stage_layers` with a vp
  stage), the embedding in rank 0's chunk 0, the final norm and output layer in the last
  rank's chunk V - 1. Each chunk's state dict is stage-local; a rank names its chunks' tensors
  `model{v}.<name>` (`chunk_name`, Megatron-LM's checkpoint keys; unchanged with one chunk),
  the names `shards.stage_entries`, the reshard plan and `shards.rank_state_dict` share.
- Multi-token prediction (`ModelDims.mtp_num_layers`, megatron-core's `mtp.layers.{i}.*`) has
  HF names in DeepSeek-V3's format only (`ModelDims.hf_mtp_layers`: the MLA family): MTP layer
  i is `model.layers.{num_layers + i}.`, its `transformer_layer.X` named and split as decoder
  layer num_layers + i's X (dense or MoE as megatron-core builds it: as the last decoder
  layer, `ModelDims.is_moe`), plus `enorm`, `hnorm`, `eh_proj` (column-parallel: rows over
  TP) and `shared_head.norm` (megatron's `final_layernorm`). DeepSeek's layer also carries
  copies of the shared `embed_tokens` and of the LM head (`shared_head.head`): written on
  export (`megatron_to_hf`), ignored on import. Other families' MTP layers have no HF names.
  megatron-core 0.19 calls that transformer layer `mtp_model_layer` (and checkpoints it as
  `transformer_layer`, as 0.16 does): both spellings map to the same HF names, and
  `shards.rank_state_dict` spells it `transformer_layer` on every release (`mtp_canonical_name`).
HF experts are named per expert (`mlp.experts.{j}.gate_proj.weight`): the hub format on disk,
which transformers 5.12.1 fuses on load into `gate_up_proj` (E, 2F, H) = [gate; up] and SGLang
loads as is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_async_rl.models.dims import HEAD_HF_NAMES, ModelDims, expert_offset

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
"""A name under MTP layer i: (i, the rest of the name)."""
_MTP_LAYER = "transformer_layer."
_MTP_LAYER_019 = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")
"""megatron-core 0.19's module name of an MTP layer's transformer layer (0.16: `_MTP_LAYER`)."""


@dataclass(frozen=True)
class ShardSpec:
    """How one (global-named) Megatron parameter is split over tensor-parallel ranks.

    `partition_dim` None means replicated. `stride` 2 means each rank holds `[gate_r; up_r]`.
    `layer` / `expert` are the global layer and expert indices (None outside layers / experts);
    for experts the TP group is the expert-TP group.
    """

    partition_dim: int | None
    stride: int = 1
    is_vocab: bool = False
    layer: int | None = None
    expert: int | None = None

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


# Megatron layer-suffix -> (HF suffixes under `model.layers.{i}.`, kind, partition dim, stride).
# Kinds: copy (same tensor), qkv (per-group interleave), glu ([gate; up]), vocab (padded rows).
_QKV = tuple(f"self_attn.{x}_proj.weight" for x in "qkv")
_LAYER_TABLE: dict[str, tuple[tuple[str, ...], str, int | None, int]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy", None, 1),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "copy", None, 1),
    "self_attention.linear_qkv.weight": (_QKV, "qkv", 0, 1),
    "self_attention.linear_qkv.bias": (tuple(n[:-6] + "bias" for n in _QKV), "qkv", 0, 1),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "copy", None, 1),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "copy", None, 1),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy", 1, 1),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy", None, 1),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "copy", None, 1),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu", 0, 2),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "copy", 1, 1),
    "linear_fc1": (("gate_proj.weight", "up_proj.weight"), "glu", 0, 2),  # expert j
    "linear_fc2": (("down_proj.weight",), "copy", 1, 1),  # expert j
}
# The same for multi-latent attention layers (te: the TE spec's spelling / split).
_MLA_TABLE: dict[str, tuple[tuple[str, ...], str, int | None, int]] = {
    "self_attention.linear_q_proj.weight": (("self_attn.q_proj.weight",), "copy", 0, 1),
    "self_attention.linear_q_down_proj.weight": (("self_attn.q_a_proj.weight",), "copy", 0, 1),
    "self_attention.linear_q_up_proj.weight": (("self_attn.q_b_proj.weight",), "copy", 0, 1),
    "self_attention.q_layernorm.weight": (("self_attn.q_a_layernorm.weight",), "copy", None, 1),
    "self_attention.linear_q_up_proj.layer_norm_weight": (
        ("self_attn.q_a_layernorm.weight",), "copy", None, 1),
    "self_attention.linear_kv_down_proj.weight": (
        ("self_attn.kv_a_proj_with_mqa.weight",), "copy", 0, 1),
    "self_attention.linear_kv_up_proj.weight": (("self_attn.kv_b_proj.weight",), "copy", 0, 1),
    "self_attention.kv_layernorm.weight": (("self_attn.kv_a_layernorm.weight",), "copy", None, 1),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (
        ("self_attn.kv_a_layernorm.weight",), "copy", None, 1),
}  # fmt: skip
_MLA_DOWN = {
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
}
_MOE_TABLE: dict[str, tuple[tuple[str, ...], str, int | None, int]] = {
    "mlp.router.weight": (("mlp.gate.weight",), "copy", None, 1),
    "mlp.router.expert_bias": (("mlp.gate.e_score_correction_bias",), "copy", None, 1),
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "glu", 0, 2),
    "mlp.shared_experts.linear_fc2.weight": (
        ("mlp.shared_experts.down_proj.weight",), "copy", 1, 1),
}  # fmt: skip
# Scalar heads (`models.heads`, `dims.HEAD_HF_NAMES`): the HF tensor of each head parameter.
_HEAD_PARAMS = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}
_GLOBAL_TABLE = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab", 0, 1),
    "output_layer.weight": (("lm_head.weight",), "vocab", 0, 1),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "copy", None, 1),
}
# An MTP layer's own tensors: Megatron suffix under `mtp.layers.{i}.` -> (HF suffix under
# `model.layers.{num_layers + i}.`, TP partition dim). eh_proj is megatron-core's column-parallel
# [h, 2h] over cat(enorm(embedding), hnorm(hidden)) (`MultiTokenPredictionLayer.
# _concat_embeddings`, 0.16.1: `torch.cat((decoder_input, hidden_states), -1)`), the order of
# DeepSeek-V3's and SGLang's `eh_proj(cat(enorm(emb), hnorm(hidden)))`: its columns map as is.
_MTP_TABLE: dict[str, tuple[str, int | None]] = {
    "enorm.weight": ("enorm.weight", None),
    "hnorm.weight": ("hnorm.weight", None),
    "eh_proj.weight": ("eh_proj.weight", 0),
    "final_layernorm.weight": ("shared_head.norm.weight", None),
}
# Copies DeepSeek-V3's MTP layers carry of tensors megatron-core shares with the main model.
_MTP_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight",
                      "shared_head.head.weight": "lm_head.weight"}  # fmt: skip
# Valid only for dense MLP layers, only for MoE layers, or behind a ModelDims switch.
_DENSE_ONLY = {"mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
_SWITCHES = {
    "self_attention.linear_qkv.bias": "add_qkv_bias",
    "self_attention.q_layernorm.weight": "qk_layernorm",
    "self_attention.k_layernorm.weight": "qk_layernorm",
}


def param_rule(name: str, dims: ModelDims) -> tuple[tuple[str, ...], str, ShardSpec]:
    """(HF names, kind, shard spec) of a global-named Megatron parameter."""
    mtp = MTP_LAYER_RE.match(mtp_canonical_name(name))
    if mtp:
        return _mtp_rule(name, int(mtp.group(1)), mtp.group(2), dims)
    m = _LAYER_RE.match(name)
    if not m and dims.head is not None and name.startswith("output_layer."):
        hf_name = _HEAD_PARAMS.get(name)
        if hf_name not in HEAD_HF_NAMES[dims.head]:
            raise ValueError(f"unknown Megatron parameter {name!r} for a {dims.head} head")
        return (hf_name,), "copy", ShardSpec(None)
    if not m:
        if name not in _GLOBAL_TABLE:
            raise ValueError(f"unknown Megatron parameter {name!r}")
        hf, kind, dim, _ = _GLOBAL_TABLE[name]
        if name == "output_layer.weight" and dims.tied_embeddings:
            hf = ()  # the last PP stage's copy of the tied embedding: HF has no tensor for it
        return hf, kind, ShardSpec(dim, is_vocab=kind == "vocab")
    layer, suffix = int(m.group(1)), m.group(2)
    if layer >= dims.num_layers:
        raise ValueError(f"{name}: layer {layer} outside num_layers={dims.num_layers}")
    return _layer_rule(name, layer, suffix, dims)


def _mtp_rule(name: str, i: int, suffix: str, dims: ModelDims):
    """`param_rule` of MTP layer i's parameter `suffix` (HF layer num_layers + i)."""
    if i >= dims.hf_mtp_layers:
        raise ValueError(
            f"{name}: MTP layer {i} has no HF name (hf_mtp_layers={dims.hf_mtp_layers}: "
            "DeepSeek-V3's format only)"
        )
    layer = dims.num_layers + i
    if suffix.startswith(_MTP_LAYER):
        return _layer_rule(name, layer, suffix[len(_MTP_LAYER) :], dims)
    if suffix not in _MTP_TABLE:
        raise ValueError(f"unknown Megatron parameter {name!r}")
    hf, dim = _MTP_TABLE[suffix]
    return (f"model.layers.{layer}.{hf}",), "copy", ShardSpec(dim, layer=layer)


def _layer_rule(name: str, layer: int, suffix: str, dims: ModelDims):
    """`param_rule` of a parameter `suffix` of (global) decoder layer `layer`."""
    moe, expert, prefix = dims.is_moe(layer), None, f"model.layers.{layer}."
    e = _EXPERT_RE.match(suffix)
    if e and moe:
        expert, suffix = int(e.group(1)), e.group(2)
        prefix = f"{prefix}mlp.experts.{expert}."
        if expert >= dims.num_experts:
            raise ValueError(f"{name}: expert {expert} outside num_experts={dims.num_experts}")
    table = _layer_table(dims, layer)
    if suffix not in table or (suffix.startswith("linear_fc") and expert is None):
        raise ValueError(f"unknown Megatron parameter {name!r} for {dims}")
    hf, kind, dim, stride = table[suffix]
    if dims.te_fused_norms and suffix in _MLA_DOWN:
        dim = None  # the TE spec's down projections are 'duplicated' on every TP rank
    return tuple(prefix + n for n in hf), kind, ShardSpec(dim, stride, False, layer, expert)


_ATTENTION_KEYS = {"input_layernorm.weight", "self_attention.linear_proj.weight"}
_MLP_NORM_KEYS = {"pre_mlp_layernorm.weight"}


def _layer_table(dims: ModelDims, layer: int) -> dict:
    """The suffix rules valid for one layer of `dims` (both the local and the TE spellings)."""
    table = {k: v for k, v in _LAYER_TABLE.items() if k in _ATTENTION_KEYS | _MLP_NORM_KEYS}
    if dims.mla is None:
        table.update(
            (k, v) for k, v in _LAYER_TABLE.items()
            if k.startswith("self_attention.") and (k not in _SWITCHES
                                                    or getattr(dims, _SWITCHES[k]))
        )  # fmt: skip
    else:
        lora = dims.mla.q_lora_rank is not None
        for k, v in _MLA_TABLE.items():
            query_side = "q_proj" in k or "q_down" in k or "q_up" in k or "q_layernorm" in k
            if "q_layernorm" in k or "kv_layernorm" in k or "layer_norm_weight" in k:
                if not dims.qk_layernorm:
                    continue
            if query_side and (k == "self_attention.linear_q_proj.weight") == lora:
                continue
            table[k] = v
    if dims.is_moe(layer):
        table["mlp.router.weight"] = _MOE_TABLE["mlp.router.weight"]
        if dims.expert_bias:
            table["mlp.router.expert_bias"] = _MOE_TABLE["mlp.router.expert_bias"]
        if dims.shared_expert_ffn:
            table.update((k, v) for k, v in _MOE_TABLE.items() if "shared_experts" in k)
        table.update((k, _LAYER_TABLE[k]) for k in ("linear_fc1", "linear_fc2"))
    else:
        table.update((k, _LAYER_TABLE[k]) for k in _DENSE_ONLY)
    return table


def shard_spec(megatron_name: str, dims: ModelDims) -> ShardSpec:
    """The TP split of a parameter named with global layer and expert indices."""
    return param_rule(megatron_name, dims)[2]


def hf_names_for(megatron_name: str, dims: ModelDims) -> tuple[str, ...]:
    """The HF tensors one Megatron parameter becomes, in `megatron_param_to_hf` order."""
    return param_rule(megatron_name, dims)[0]


def _attention_suffixes(dims: ModelDims) -> list[str]:
    te, mla = dims.te_fused_norms, dims.mla
    if mla is None:
        return [
            "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight",
            "self_attention.linear_qkv.weight",
            *(["self_attention.linear_qkv.bias"] if dims.add_qkv_bias else []),
            *(
                ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
                if dims.qk_layernorm
                else []
            ),
            "self_attention.linear_proj.weight",
        ]
    norms = dims.qk_layernorm
    if mla.q_lora_rank is None:
        query = ["self_attention.linear_q_proj.weight"]
    else:
        query = [
            "self_attention.linear_q_down_proj.weight",
            "self_attention.linear_q_up_proj.weight",
            *(["self_attention.linear_q_up_proj.layer_norm_weight" if te
               else "self_attention.q_layernorm.weight"] if norms else []),
        ]  # fmt: skip
    return [
        "input_layernorm.weight",  # MLA's TE spec keeps it whole: two projections read it
        *query,
        "self_attention.linear_kv_down_proj.weight",
        "self_attention.linear_kv_up_proj.weight",
        *(["self_attention.linear_kv_up_proj.layer_norm_weight" if te
           else "self_attention.kv_layernorm.weight"] if norms else []),
        "self_attention.linear_proj.weight",
    ]  # fmt: skip


def _layer_param_names(dims: ModelDims, layer: int, experts: range) -> list[str]:
    te, moe = dims.te_fused_norms, dims.is_moe(layer)
    suffixes = [
        *_attention_suffixes(dims),
        "mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight",
    ]
    if not moe:
        suffixes += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    else:
        suffixes.append("mlp.router.weight")
        if dims.expert_bias:
            suffixes.append("mlp.router.expert_bias")
        for j in experts:
            suffixes += [f"mlp.experts.local_experts.{j}.linear_fc{k}.weight" for k in (1, 2)]
        if dims.shared_expert_ffn:
            suffixes += [f"mlp.shared_experts.linear_fc{k}.weight" for k in (1, 2)]
    return [f"decoder.layers.{layer}.{s}" for s in suffixes]


def stage_param_names(
    dims: ModelDims,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    vp_stage: int | None = None,
) -> list[str]:
    """Global names of the parameters one (pp_rank, ep_rank) holds; all of them by default.
    With virtual pipeline stages (`ModelDims.vp_size`), those of its model chunk `vp_stage`,
    or of all its chunks in chunk order when `vp_stage` is None."""
    chunks = dims.chunks(pp_size)
    if len(chunks) > 1 and vp_stage is None:
        return [
            name for v in chunks for name in stage_param_names(
                dims, pp_rank=pp_rank, pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size,
                vp_stage=v,
            )
        ]  # fmt: skip
    layers = dims.stage_layers(pp_rank, pp_size, vp_stage)
    experts = range(0)
    if dims.num_experts is not None:
        e0 = expert_offset(ep_rank, ep_size, dims.num_experts)
        experts = range(e0, e0 + dims.num_experts // ep_size)
    first_chunk = len(chunks) == 1 or vp_stage == 0
    last_chunk = len(chunks) == 1 or vp_stage == len(chunks) - 1
    names = ["embedding.word_embeddings.weight"] if pp_rank == 0 and first_chunk else []
    for layer in layers:
        names += _layer_param_names(dims, layer, experts)
    if pp_rank == pp_size - 1 and last_chunk:
        names.append("decoder.final_layernorm.weight")
        if not dims.tied_embeddings or pp_size > 1:
            names.append("output_layer.weight")
        if dims.head == "value":
            names.append("output_layer.bias")
        for i in range(dims.hf_mtp_layers):  # megatron-core's order within an MTP layer
            layer = _layer_param_names(dims, dims.num_layers + i, experts)
            names += [f"mtp.layers.{i}.{s}" for s in ("enorm.weight", "hnorm.weight",
                                                      "eh_proj.weight")]  # fmt: skip
            names += [f"mtp.layers.{i}.{_MTP_LAYER}{n.split('.', 3)[3]}" for n in layer]
            names.append(f"mtp.layers.{i}.final_layernorm.weight")
    return names


def _shift(name: str, layer_delta: int, expert_delta: int) -> str:
    name = mtp_canonical_name(name)
    mtp = MTP_LAYER_RE.match(name)
    if mtp and mtp[2].startswith(_MTP_LAYER):  # on the last stage: only experts shift
        suffix = _shift(f"decoder.layers.0.{mtp[2][len(_MTP_LAYER) :]}", 0, expert_delta)
        return f"mtp.layers.{mtp[1]}.{_MTP_LAYER}{suffix.split('.', 3)[3]}"
    m = _LAYER_RE.match(name)
    if not m:
        return name
    suffix = re.sub(
        r"^(mlp\.experts\.local_experts\.)(\d+)",
        lambda e: f"{e[1]}{int(e[2]) + expert_delta}",
        m[2],
    )
    return f"decoder.layers.{int(m.group(1)) + layer_delta}.{suffix}"


def to_global_name(local_name: str, *, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """A rank's state-dict name (stage-local layer, EP-local expert) -> the global name."""
    return _shift(local_name, layer_offset, expert_offset)


def to_local_name(global_name: str, *, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Inverse of `to_global_name`."""
    return _shift(global_name, -layer_offset, -expert_offset)


def chunk_name(name: str, vp_stage: int, num_chunks: int) -> str:
    """A model chunk's own state-dict name as a rank names it among its `num_chunks` chunks:
    unchanged for one chunk, else prefixed `model{vp_stage}.` (Megatron-LM's checkpoint keys of
    model chunks)."""
    return name if num_chunks == 1 else f"model{vp_stage}.{name}"


def split_chunk_name(name: str, num_chunks: int) -> tuple[int, str]:
    """Inverse of `chunk_name`: (vp_stage, the chunk's own name)."""
    if num_chunks == 1:
        return 0, name
    m = re.match(r"^model(\d+)\.(.+)$", name)
    if not m or int(m[1]) >= num_chunks:
        raise ValueError(f"{name!r} is not the name of one of {num_chunks} model chunks")
    return int(m[1]), m[2]


def mtp_canonical_name(name: str) -> str:
    """`name` with an MTP layer's transformer layer spelled `transformer_layer.` whatever the
    megatron-core release (0.19's module is `mtp_model_layer`; both releases checkpoint it as
    `transformer_layer`); other names unchanged."""
    return _MTP_LAYER_019.sub(rf"\1{_MTP_LAYER}", name)


def mtp_layers_in(hf_names: Iterable[str], dims: ModelDims) -> int:
    """How many of the model's HF-named MTP layers (`hf_mtp_layers`, from 0 on) a HF checkpoint
    carries: DeepSeek-V3's `num_nextn_predict_layers`, read from its tensor names."""
    names = set(hf_names)
    found = 0
    while found < dims.hf_mtp_layers and (
        f"model.layers.{dims.num_layers + found}.eh_proj.weight" in names
    ):
        found += 1
    return found


def rank_global_name(
    name: str, dims: ModelDims, *, pp_rank: int, pp_size: int, expert_offset: int = 0
) -> str:
    """The global name of a rank's `rank_state_dict` name (chunk, stage-local layer, EP-local
    expert -> global layer and expert)."""
    chunks = dims.chunks(pp_size)
    vp_stage, local = split_chunk_name(name, len(chunks))
    l0 = dims.stage_layers(pp_rank, pp_size, vp_stage if len(chunks) > 1 else None).start
    return to_global_name(local, layer_offset=l0, expert_offset=expert_offset)


def pad_vocab(tensor: Tensor, padded_size: int) -> Tensor:
    """Appends zero rows up to `padded_size`. Logits of padded rows must be masked by callers."""
    if padded_size < tensor.shape[0]:
        raise ValueError(f"padded_size={padded_size} < vocab rows {tensor.shape[0]}")
    if padded_size == tensor.shape[0]:
        return tensor
    pad = tensor.new_zeros((padded_size - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


def unpad_vocab(tensor: Tensor, vocab_size: int, copy: bool = True) -> Tensor:
    if tensor.shape[0] == vocab_size:
        return tensor
    return tensor[:vocab_size].clone() if copy else tensor[:vocab_size]


def megatron_param_to_hf(
    name: str, tensor: Tensor, dims: ModelDims, copy: bool = True
) -> list[tuple[str, Tensor]]:
    """One full (gathered, global-named) Megatron tensor -> its HF tensors, each owning storage.

    Owning matters: a view keeps (and pickles / IPC-shares) the whole fused storage. With
    `copy=False` the HF tensors are views of `tensor` instead (no copy; q/k/v then keep their
    per-query-group shape, e.g. [groups, heads per group, head dim, hidden], whose row-major
    order is the HF tensor's): for a caller that copies them into a buffer right away.
    """
    hf, kind, _ = param_rule(name, dims)
    if kind == "copy":
        return [(hf[0], tensor)]
    if kind == "vocab":
        return [(n, unpad_vocab(tensor, dims.vocab_size, copy)) for n in hf]
    if kind == "glu":
        gate, up = tensor.chunk(2, dim=0)
        return [(hf[0], gate.clone() if copy else gate), (hf[1], up.clone() if copy else up)]
    ng, d = dims.num_query_groups, dims.head_dim
    per_group = dims.num_attention_heads // ng
    grouped = tensor.reshape(ng, per_group + 2, d, *tensor.shape[1:])
    q, k, v = grouped[:, :per_group], grouped[:, per_group], grouped[:, per_group + 1]
    if not copy:
        return list(zip(hf, (q, k, v), strict=True))
    rest = tuple(tensor.shape[1:])
    q = q.reshape(ng * per_group * d, *rest).clone()
    k = k.reshape(ng * d, *rest).clone()
    v = v.reshape(ng * d, *rest).clone()
    return list(zip(hf, (q, k, v), strict=True))


def hf_to_megatron_param(name: str, hf_tensors: list[Tensor], dims: ModelDims) -> Tensor:
    """The inverse of `megatron_param_to_hf`, from the tensors named by `hf_names_for`."""
    kind = param_rule(name, dims)[1]
    if kind == "copy":
        return hf_tensors[0]
    if kind == "vocab":
        return pad_vocab(hf_tensors[0], dims.padded_vocab_size or dims.vocab_size)
    if kind == "glu":
        return torch.cat(hf_tensors, dim=0)
    q, k, v = hf_tensors
    ng, d = dims.num_query_groups, dims.head_dim
    rest = tuple(q.shape[1:])
    parts = [
        q.reshape(ng, dims.num_attention_heads // ng, d, *rest),
        k.reshape(ng, 1, d, *rest),
        v.reshape(ng, 1, d, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def hf_to_megatron(hf_sd: Mapping[str, Tensor], dims: ModelDims) -> dict[str, Tensor]:
    """A full HF state dict in hub layout -> the full (TP=PP=EP=1, global-named) Megatron one.

    Hub layout is what `hf_checkpoint.load_hf_state_dict` returns; a transformers 5 module's
    own `state_dict()` fuses MoE experts: pass it through `hf_checkpoint.to_hub_layout` first.
    """
    check_hf_names(hf_sd.keys(), dims)
    return {
        name: hf_to_megatron_param(name, [hf_sd[h] for h in hf_names_for(name, dims)], dims)
        for name in stage_param_names(dims)
    }


def megatron_to_hf(mc_sd: Mapping[str, Tensor], dims: ModelDims) -> dict[str, Tensor]:
    """A full global-named Megatron state dict -> HF state dict (`_extra_state` ignored)."""
    out: dict[str, Tensor] = {}
    for name, tensor in mc_sd.items():
        if not name.endswith("._extra_state"):
            out.update(megatron_param_to_hf(name, tensor, dims))
    expected = {hf for name in stage_param_names(dims) for hf in hf_names_for(name, dims)}
    missing = sorted(expected - out.keys())
    if missing:
        raise ValueError(f"Megatron state dict lacks the sources of HF tensors {missing[:8]}")
    # DeepSeek-V3's MTP layers hold their own copies of the shared embedding and LM head (as
    # SGLang's DeepseekV3ForCausalLMNextN loads them); owned: safetensors refuses shared storage
    for i in range(dims.hf_mtp_layers):
        for suffix, main in _MTP_SHARED_COPIES.items():
            source = out["model.embed_tokens.weight"] if dims.tied_embeddings else out[main]
            out[f"model.layers.{dims.num_layers + i}.{suffix}"] = source.clone()
    return out


def check_hf_names(names: Iterable[str], dims: ModelDims) -> None:
    """The rules `hf_to_megatron` applies to a whole checkpoint, on its tensor names only:
    every source of every parameter is present, and nothing is left without a counterpart."""
    names = set(names)
    needed = {h for name in stage_param_names(dims) for h in hf_names_for(name, dims)}
    missing = sorted(needed - names)
    if missing and dims.head is None and "score.weight" in names:
        raise ValueError(
            f"HF state dict lacks {missing[:8]} but has score.weight: a classification "
            f"checkpoint (reward model or critic) loads into a model with a scalar head "
            f"(head={tuple(HEAD_HF_NAMES)})"
        )
    if missing:
        raise ValueError(f"HF state dict lacks {missing[:8]} needed for Megatron parameters")
    # A tied checkpoint may still carry lm_head, and a policy's loaded under a scalar head does;
    # old ones carry rotary buffers.
    ignorable = {"lm_head.weight"} if dims.tied_embeddings or dims.head else set()
    extra = sorted(
        n for n in names - needed - ignorable
        if not n.endswith("rotary_emb.inv_freq") and not _beyond_layers(n, dims)
    )  # fmt: skip
    if extra:
        raise ValueError(f"HF state dict has tensors with no Megatron counterpart: {extra[:8]}")


def _beyond_layers(hf_name: str, dims: ModelDims) -> bool:
    """A tensor of a layer past num_layers that is not loaded: DeepSeek-V3's multi-token-
    prediction layers past `hf_mtp_layers` (transformers and the engines' causal LM do not load
    them either), and the copies of the shared embedding and LM head in the loaded ones."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if not m or int(m.group(1)) < dims.num_layers:
        return False
    return int(m.group(1)) >= dims.num_layers + dims.hf_mtp_layers or (
        m.group(2) in _MTP_SHARED_COPIES
    )
