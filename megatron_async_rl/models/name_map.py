"""Names and layouts between Megatron-core GPT (0.16.1) and HF llama/qwen2/qwen3(_moe)/deepseek_v3.

The single source of truth for: which HF tensors a Megatron parameter becomes (and back), how a
full Megatron tensor is split across tensor-parallel ranks (and gathered back), and how stage-local
layer / expert indices map to global ones. Called by HF loading and export (`hf_to_megatron`,
`megatron_to_hf`), sharded loading (`stage_state_dict`) and weight sync (`shard_spec`, `unshard`,
`megatron_param_to_hf`, `to_global_name`). Pure torch: no `torch.distributed`, no megatron
(but megatron-core's parser for a --pipeline-model-parallel-layout).

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
  pipeline rank p the layers of virtual stage v x pp + p (`stage_layers` with a vp stage), the
  embedding in rank 0's chunk 0, the final norm and output layer in the last rank's chunk V - 1.
  Each chunk's state dict is stage-local; a rank names its chunks' tensors `model{v}.<name>`
  (`chunk_name`, Megatron-LM's checkpoint keys; unchanged with one chunk), the names
  `stage_entries`, the reshard plan and `rank_state_dict` share.
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
  `rank_state_dict` spells it `transformer_layer` on every release (`mtp_canonical_name`).
HF experts are named per expert (`mlp.experts.{j}.gate_proj.weight`): the hub format on disk,
which transformers 5.12.1 fuses on load into `gate_up_proj` (E, 2F, H) = [gate; up] and SGLang
loads as is.

Past 600 lines on purpose: the names, the shard specs and the stage layouts are one mapping,
read together when a family or a layout is added.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_MTP_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = "transformer_layer."
_MTP_LAYER_019 = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")
"""megatron-core 0.19's module name of an MTP layer's transformer layer (0.16: `_MTP_LAYER`)."""


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention sizes (Megatron names; HF: q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim


def moe_layer_pattern(freq: Any, num_layers: int) -> tuple[int, ...]:
    """1 for a MoE layer, 0 for a dense one, as megatron-core reads --moe-layer-freq (an int N:
    every N-th layer from 0; a list: the pattern itself)."""
    if isinstance(freq, int):
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    pattern = tuple(int(x) for x in freq)
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise ValueError(f"moe_layer_freq={list(freq)} must be {num_layers} zeros and ones")
    return pattern


@dataclass(frozen=True)
class ModelDims:
    """Shapes and switches that decide names and layouts; `head_dim` is Megatron `kv_channels`."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    te_fused_norms: bool = False
    padded_vocab_size: int | None = None
    first_stage_layers: int | None = None
    """--decoder-first-pipeline-num-layers (megatron-core num_layers_in_first_pipeline_stage)."""
    last_stage_layers: int | None = None
    """--decoder-last-pipeline-num-layers (num_layers_in_last_pipeline_stage)."""
    mla: MLADims | None = None
    moe_layers: tuple[int, ...] | None = None
    """Which layers are MoE (1) or dense (0), when num_experts is set; None: every layer."""
    shared_expert_ffn: int | None = None
    """--moe-shared-expert-intermediate-size."""
    expert_bias: bool = False
    """--moe-router-enable-expert-bias (a router buffer the engines read)."""
    layout_layers: tuple[int, ...] | None = None
    """Decoder layers per pipeline stage from --pipeline-model-parallel-layout (None: even or
    first/last splits)."""
    head: str | None = None
    """A scalar head in place of the LM head (`HEAD_HF_NAMES`): "value" (HF
    `*ForTokenClassification`), "score" (`*ForSequenceClassification`); None: `lm_head`."""
    vp_size: int = 1
    """Model chunks per pipeline rank (virtual pipeline stages, `megatron_flags.virtual_stages`):
    chunk v of pipeline rank p is virtual stage v x pp + p; one chunk when pp is 1."""
    mtp_num_layers: int = 0
    """--mtp-num-layers (megatron-core's `mtp.layers.{i}`, on the last pipeline stage); HF names
    for them only where `hf_mtp_layers` says."""

    @property
    def hf_mtp_layers(self) -> int:
        """The MTP layers with HF names: all of them in DeepSeek-V3's format (multi-latent
        attention is that family's here), none in the others' (they then start fresh on HF
        load and are left out of HF export)."""
        return self.mtp_num_layers if self.mla is not None else 0

    def is_moe(self, layer: int) -> bool:
        if self.num_experts is None:
            return False
        if layer >= self.num_layers:  # MTP layer layer - num_layers: megatron-core repeats the
            layer = self.num_layers - 1  # last decoder layer's spec (`get_gpt_mtp_block_spec`)
        return self.moe_layers is None or bool(self.moe_layers[layer])

    def stage_layers(self, pp_rank: int, pp_size: int, vp_stage: int | None = None) -> range:
        """Global indices of the decoder layers pipeline stage `pp_rank` holds; with virtual
        pipeline stages, those of its model chunk `vp_stage` (as megatron-core's
        `get_transformer_layer_offset` with a vp_stage: the model is split into `vp_size`
        rounds of num_layers / vp_size layers, each round over the pipeline stages as without
        virtual stages, first/last stage layers divided by vp_size)."""
        if self.vp_size > 1 and pp_size > 1:
            if vp_stage is None or not 0 <= vp_stage < self.vp_size:
                raise ValueError(
                    f"vp_stage={vp_stage}: a model of {self.vp_size} virtual pipeline stages "
                    f"per rank needs the model chunk (0..{self.vp_size - 1})"
                )
            if self.layout_layers is not None:
                raise ValueError("virtual pipeline stages from a layout are not mapped")
            sizes = (self.num_layers, self.first_stage_layers or 0, self.last_stage_layers or 0)
            if any(n % self.vp_size for n in sizes):
                raise ValueError(
                    f"num_layers={self.num_layers}, first={self.first_stage_layers} and "
                    f"last={self.last_stage_layers} stage layers must be divisible by "
                    f"vp_size={self.vp_size}"
                )
            per_round = self.num_layers // self.vp_size
            first, last = (None if n is None else n // self.vp_size
                           for n in (self.first_stage_layers, self.last_stage_layers))
            part = stage_layers(pp_rank, pp_size, per_round, first, last)
            return range(vp_stage * per_round + part.start, vp_stage * per_round + part.stop)
        if self.layout_layers is not None and pp_size > 1:  # pp_size 1: the whole model
            if len(self.layout_layers) != pp_size:
                raise ValueError(f"the layout has {len(self.layout_layers)} stages, not {pp_size}")
            start = sum(self.layout_layers[:pp_rank])
            return range(start, start + self.layout_layers[pp_rank])
        return stage_layers(
            pp_rank, pp_size, self.num_layers, self.first_stage_layers, self.last_stage_layers
        )

    def chunks(self, pp_size: int) -> range:
        """The model chunks (vp stages) of a pipeline rank: one when pp_size is 1."""
        return range(self.vp_size if pp_size > 1 else 1)

    def __post_init__(self) -> None:
        if self.vp_size < 1:
            raise ValueError(f"vp_size={self.vp_size} must be >= 1")
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers={self.mtp_num_layers} must be >= 0")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if (self.num_experts is None) != (self.moe_ffn_hidden_size is None):
            raise ValueError("num_experts and moe_ffn_hidden_size must be set together")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}"
            )
        if self.head is not None and self.head not in HEAD_HF_NAMES:
            raise ValueError(f"head={self.head!r} is not one of {tuple(HEAD_HF_NAMES)} or None")
        if self.head is not None and self.tied_embeddings:
            raise ValueError(f"a {self.head} head replaces the output layer: untie the embeddings")

    @classmethod
    def from_megatron_args(cls, args: Mapping[str, Any] | Any) -> ModelDims:
        """From a Megatron args dict or Namespace (e.g. `hf_config.megatron_args_from_hf`)."""
        a = args if isinstance(args, Mapping) else vars(args)
        heads = int(a["num_attention_heads"])
        num_experts = a.get("num_experts") or None
        mla = None
        if a.get("multi_latent_attention"):
            q_lora = a.get("q_lora_rank")
            mla = MLADims(
                int(q_lora) if q_lora else None, int(a["kv_lora_rank"]), int(a["qk_head_dim"]),
                int(a["qk_pos_emb_head_dim"]), int(a["v_head_dim"]),
            )  # fmt: skip
        layout_layers = None
        if a.get("pipeline_model_parallel_layout"):  # megatron-core's own parser
            from megatron_async_rl.config.megatron_rules import layout_stage_layers

            layout_layers = layout_stage_layers(
                a["pipeline_model_parallel_layout"], int(a["pipeline_model_parallel_size"]),
                int(a["num_layers"]), a.get("mtp_num_layers"),
            )  # fmt: skip
        from megatron_async_rl.config.megatron_flags import virtual_stages

        moe_layers = None
        if num_experts and a.get("moe_layer_freq", 1) != 1:
            moe_layers = moe_layer_pattern(a["moe_layer_freq"], int(a["num_layers"]))
            moe_layers = None if all(moe_layers) else moe_layers
        return cls(
            num_layers=int(a["num_layers"]),
            hidden_size=int(a["hidden_size"]),
            num_attention_heads=heads,
            num_query_groups=int(
                a["num_query_groups"] if a.get("group_query_attention") else heads
            ),
            head_dim=int(a.get("kv_channels") or a["hidden_size"] // heads),
            ffn_hidden_size=int(a["ffn_hidden_size"]),
            vocab_size=int(a["vocab_size"]),
            tied_embeddings=not a.get("untie_embeddings_and_output_weights", False),
            add_qkv_bias=bool(a.get("add_qkv_bias", False)),
            qk_layernorm=bool(a.get("qk_layernorm", False)),
            num_experts=num_experts,
            moe_ffn_hidden_size=a.get("moe_ffn_hidden_size") if num_experts else None,
            te_fused_norms=a.get("transformer_impl") == "transformer_engine",
            padded_vocab_size=a.get("padded_vocab_size"),
            first_stage_layers=a.get("num_layers_in_first_pipeline_stage"),
            last_stage_layers=a.get("num_layers_in_last_pipeline_stage"),
            mla=mla,
            moe_layers=moe_layers,
            shared_expert_ffn=(a.get("moe_shared_expert_intermediate_size") or None)
            if num_experts else None,
            expert_bias=bool(num_experts and a.get("moe_router_enable_expert_bias")),
            layout_layers=layout_layers,
            vp_size=virtual_stages(a),
        )


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
# Scalar heads (`models.heads`): the HF tensors of each kind, and which Megatron parameter each is.
HEAD_HF_NAMES = {"value": ("score.weight", "score.bias"), "score": ("score.weight",)}
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


def _rule(name: str, dims: ModelDims) -> tuple[tuple[str, ...], str, ShardSpec]:
    """(HF names, kind, shard spec) of a global-named Megatron parameter."""
    mtp = _MTP_RE.match(mtp_canonical_name(name))
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
    """`_rule` of MTP layer i's parameter `suffix` (HF layer num_layers + i)."""
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
    """`_rule` of a parameter `suffix` of (global) decoder layer `layer`."""
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
    return _rule(megatron_name, dims)[2]


def hf_names_for(megatron_name: str, dims: ModelDims) -> tuple[str, ...]:
    """The HF tensors one Megatron parameter becomes, in `megatron_param_to_hf` order."""
    return _rule(megatron_name, dims)[0]


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


def stage_layers(
    pp_rank: int, pp_size: int, num_layers: int, first: int | None = None, last: int | None = None
) -> range:
    """Global indices of the decoder layers of pipeline stage `pp_rank`, as megatron-core's
    `get_transformer_layer_offset` and `get_num_layers_to_build` split them: the first and last
    stages hold `first` / `last` layers where set, the other stages share the rest evenly."""
    if pp_size == 1:
        return range(num_layers)
    if first is None and last is None and num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp_size={pp_size}")
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages and middle_layers % middle_stages):
        raise ValueError(
            f"num_layers={num_layers} minus first={first} and last={last} stage layers does not "
            f"split evenly over the {middle_stages} other pipeline stages"
        )
    if middle_stages == 0 and middle_layers:
        raise ValueError(f"first={first} + last={last} stage layers != num_layers={num_layers}")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    if first is not None and pp_rank == 0:
        return range(0, first)
    if last is not None and pp_rank == pp_size - 1:
        return range(num_layers - last, num_layers)
    start = (first or 0) + (pp_rank - (first is not None)) * per_middle
    return range(start, start + per_middle)


def layer_offset(pp_rank: int, pp_size: int, num_layers: int) -> int:
    """Global index of a pipeline stage's first layer (even splits)."""
    return stage_layers(pp_rank, pp_size, num_layers).start


def expert_offset(ep_rank: int, ep_size: int, num_experts: int) -> int:
    """Global index of an expert-parallel rank's local expert 0."""
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    return ep_rank * (num_experts // ep_size)


def _shift(name: str, layer_delta: int, expert_delta: int) -> str:
    name = mtp_canonical_name(name)
    mtp = _MTP_RE.match(name)
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


def mtp_canonical_name(name: str) -> str:
    """`name` with an MTP layer's transformer layer spelled `transformer_layer.` whatever the
    megatron-core release (0.19's module is `mtp_model_layer`; both releases checkpoint it as
    `transformer_layer`); other names unchanged."""
    return _MTP_LAYER_019.sub(rf"\1{_MTP_LAYER}", name)


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
    m = _MTP_RE.match(name)
    return bool(m) and int(m.group(1)) < mtp_num_layers


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


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding rule: round up to a multiple of `divisible_by * tp_size`."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


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
    hf, kind, _ = _rule(name, dims)
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
    kind = _rule(name, dims)[1]
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
    sources, kind, _ = _rule(name, dims)
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


def hf_shape(hf_name: str, dims: ModelDims) -> tuple[int, ...]:
    """Full shape of one HF tensor, from HF conventions (independent of Megatron's layouts)."""
    h, d, nq, ng = dims.hidden_size, dims.head_dim, dims.num_attention_heads, dims.num_query_groups
    ffn = dims.moe_ffn_hidden_size if ".experts." in hf_name else dims.ffn_hidden_size
    if ".shared_experts." in hf_name:
        ffn = dims.shared_expert_ffn
    shapes = {
        "embed_tokens.weight": (dims.vocab_size, h),
        "lm_head.weight": (dims.vocab_size, h),
        "q_proj.weight": (nq * d, h),
        "k_proj.weight": (ng * d, h),
        "v_proj.weight": (ng * d, h),
        "q_proj.bias": (nq * d,),
        "k_proj.bias": (ng * d,),
        "v_proj.bias": (ng * d,),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "o_proj.weight": (h, nq * d),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "gate_proj.weight": (ffn, h),
        "up_proj.weight": (ffn, h),
        "down_proj.weight": (h, ffn),
        "gate.weight": (dims.num_experts, h),
        "gate.e_score_correction_bias": (dims.num_experts,),
        "score.weight": (1, h),
        "score.bias": (1,),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
    }
    if dims.mla is not None:
        m = dims.mla
        shapes.update({
            "q_proj.weight": (nq * m.q_head_dim, h),
            "q_a_proj.weight": (m.q_lora_rank, h),
            "q_a_layernorm.weight": (m.q_lora_rank,),
            "q_b_proj.weight": (nq * m.q_head_dim, m.q_lora_rank),
            "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_pos_emb_head_dim, h),
            "kv_a_layernorm.weight": (m.kv_lora_rank,),
            "kv_b_proj.weight": (nq * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank),
            "o_proj.weight": (h, nq * m.v_head_dim),
        })  # fmt: skip
    suffix = ".".join(hf_name.split(".")[-2:])
    if suffix not in shapes:
        raise ValueError(f"no HF shape rule for tensor {hf_name!r}")
    return shapes[suffix]


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
