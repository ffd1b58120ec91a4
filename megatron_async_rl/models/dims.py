"""The sizes and switches of a Megatron GPT model that decide its names and layouts.

Owned here: `ModelDims` (read from Megatron args: layers, heads, experts, MLA, MTP, pipeline and
virtual-pipeline splits, a scalar head) and the arithmetic on it: which decoder layers a
pipeline stage (and model chunk) holds (`stage_layers`, `ModelDims.stage_layers`), an
expert-parallel rank's first expert (`expert_offset`), Megatron's padded vocabulary
(`padded_vocab_size`) and the full shape of each HF tensor (`hf_shape`). The bottom of the
three modules `dims` -> `names` -> `shards`: imports neither of them. Pure: no torch, no
megatron (but megatron-core's parser for a --pipeline-model-parallel-layout, lazily).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
    """Model chunks per pipeline rank (virtual pipeline stages, `core_kwargs.virtual_stages`):
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
            from megatron_async_rl.config.megatron.rules import layout_stage_layers

            layout_layers = layout_stage_layers(
                a["pipeline_model_parallel_layout"], int(a["pipeline_model_parallel_size"]),
                int(a["num_layers"]), a.get("mtp_num_layers"),
            )  # fmt: skip
        from megatron_async_rl.config.megatron.core_kwargs import virtual_stages

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


# Scalar heads (`models.heads`): the HF tensors of each kind (`names` maps each to its Megatron
# parameter).
HEAD_HF_NAMES = {"value": ("score.weight", "score.bias"), "score": ("score.weight",)}


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


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding rule: round up to a multiple of `divisible_by * tp_size`."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


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
