"""HuggingFace `deepseek_v3` `config.json` <-> Megatron-LM model arguments (multi-latent attention).

Owns the architectural translation for the DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2,
Moonlight), called through `hf_config.megatron_args_from_hf` / `hf_config_from_megatron_args`.
Pure Python. Read from transformers 5.12.1 `modeling_deepseek_v3.py` and megatron-core 0.16.1
`multi_latent_attention.py` / `moe/moe_utils.py`, and logits-checked (fp32, 1.4e-6;
`tests/distributed/test_hf_parity.py`):

- **Attention.** HF `q_a_proj`/`q_a_layernorm`/`q_b_proj` (or `q_proj` without a query LoRA),
  `kv_a_proj_with_mqa` = `[kv latent; shared rope key]`, `kv_a_layernorm`, `kv_b_proj` with
  per-head `[k_nope; v]` rows: megatron-core's `linear_q_down_proj`, `q_layernorm`,
  `linear_q_up_proj`, `linear_kv_down_proj`, `kv_layernorm`, `linear_kv_up_proj`, in the same
  row orders. megatron-core's MLA always de-interleaves the rope half (`[0::2], [1::2]`) before
  rotating, which is HF's `rope_interleave=True` (the default, and DeepSeek's checkpoints); HF's
  `rope_interleave=False` would need the weights permuted and is refused.
- **RoPE.** Default RoPE is megatron's `rope_type="rope"` with `rotary_scaling_factor=1` (the MLA
  softmax scale uses `mscale_all_dim` and the factor whatever the rope type). YaRN maps key for
  key (factor, original_max_position_embeddings, beta_fast/slow, mscale, mscale_all_dim); HF
  scales cos/sin by `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` only when both are
  given (else `mscale(factor, 1)`), so a config giving only `mscale_all_dim` is refused.
- **MoE.** The first `first_k_dense_replace` layers are dense (`--moe-layer-freq` as a list), the
  rest have `n_routed_experts` experts and `n_shared_experts x moe_intermediate_size` of shared
  expert. Routing: `s = sigmoid(logits)` in fp32, the expert choice on `s + e_score_correction_bias`
  (megatron's `expert_bias`) limited to `topk_group` of `n_group` groups, weights `s` of the
  chosen experts renormalised and times `routed_scaling_factor`. megatron-core scores a group by
  the sum of its top `topk // group_topk` experts, HF by its top 2: equal only when
  `num_experts_per_tok == 2 x topk_group` (true of DeepSeek-V3: 8 = 2 x 4), refused otherwise;
  megatron-core always renormalises sigmoid weights (top-k > 1), so `norm_topk_prob` must be true.
"""

from __future__ import annotations

from typing import Any

from megatron_async_rl.models.hf_keys import (
    ARCHITECTURES,
    expect_arg,
    get_arg,
    require,
    unsupported,
    with_base,
)


def _rope_args(cfg: dict) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    plain = {"rope_type": "rope", "rotary_base": theta, "rotary_scaling_factor": 1.0,
             "mscale": 1.0, "mscale_all_dim": 0.0}  # fmt: skip
    if rope_type == "default":
        return plain
    if rope_type != "yarn":
        raise unsupported("rope_parameters.rope_type", rope_type, "'default' or 'yarn'")
    for key, ok in (("attention_factor", None), ("truncate", True)):
        if params.get(key, ok) != ok:
            raise unsupported(f"rope_parameters.{key}", params[key], f"must be {ok}")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise unsupported(
            "rope_parameters.mscale", mscale,
            "needed with mscale_all_dim (transformers then scales cos/sin by mscale(factor, 1))",
        )  # fmt: skip
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0  # what transformers computes without the pair
    return {
        **plain,
        "rope_type": "yarn",
        "rotary_scaling_factor": float(require(params, "factor")),
        "original_max_position_embeddings": int(
            params.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        ),
        "beta_fast": float(params.get("beta_fast", 32.0)),
        "beta_slow": float(params.get("beta_slow", 1.0)),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
    }


def _moe_args(cfg: dict, num_layers: int) -> dict[str, Any]:
    experts = int(require(cfg, "n_routed_experts"))
    top_k = int(require(cfg, "num_experts_per_tok"))
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                        ("moe_layer_freq", 1), ("hidden_act", "silu"),
                        ("attention_bias", False), ("rope_interleave", True)):  # fmt: skip
        if cfg.get(key, wanted) != wanted:
            raise unsupported(key, cfg[key], f"only {wanted!r} is built here")
    if top_k > 1 and not cfg.get("norm_topk_prob", True):
        raise unsupported(
            "norm_topk_prob", False, "megatron-core renormalises sigmoid routing weights"
        )
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups > 1 and top_k != 2 * group_topk:
        raise unsupported(
            "topk_group", group_topk,
            f"with n_group={groups} megatron-core scores a group by its top num_experts_per_tok"
            f" // topk_group = {top_k // group_topk} experts, transformers by its top 2",
        )  # fmt: skip
    dense = int(cfg.get("first_k_dense_replace") or 0)
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_ffn = int(require(cfg, "moe_intermediate_size"))
    return {
        "num_experts": experts,
        "moe_router_topk": top_k,
        "moe_ffn_hidden_size": moe_ffn,
        "moe_layer_freq": [0] * min(dense, num_layers) + [1] * max(num_layers - dense, 0),
        "moe_shared_expert_intermediate_size": shared * moe_ffn if shared else None,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": group_topk if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "moe_router_dtype": "fp32",
    }


def megatron_args_from_hf(cfg: dict) -> dict[str, Any]:
    """Megatron-LM arg dest names -> values describing the same network as a deepseek_v3 config."""
    heads = int(require(cfg, "num_attention_heads"))
    if cfg.get("num_key_value_heads", heads) != heads:
        raise unsupported(
            "num_key_value_heads", cfg["num_key_value_heads"], f"MLA needs {heads} (one per head)"
        )
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise unsupported("pretraining_tp", cfg["pretraining_tp"], "must be 1")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise unsupported(
            "quantization_config", method,
            "a quantized checkpoint (DeepSeek's are fp8 with block scales) is trained from its "
            "bf16 weights: dequantize it first (e.g. DeepSeek's fp8_cast_bf16.py)",
        )  # fmt: skip
    num_layers = int(require(cfg, "num_hidden_layers"))
    q_lora = cfg.get("q_lora_rank")
    return {
        "num_layers": num_layers,
        "hidden_size": int(require(cfg, "hidden_size")),
        "ffn_hidden_size": int(require(cfg, "intermediate_size")),
        "num_attention_heads": heads,
        "group_query_attention": False,
        "multi_latent_attention": True,
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(require(cfg, "kv_lora_rank")),
        "qk_head_dim": int(require(cfg, "qk_nope_head_dim")),
        "qk_pos_emb_head_dim": int(require(cfg, "qk_rope_head_dim")),
        "v_head_dim": int(require(cfg, "v_head_dim")),
        "swiglu": True,
        "normalization": "RMSNorm",
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        **_rope_args(cfg),
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "vocab_size": int(require(cfg, "vocab_size")),
        "max_position_embeddings": int(require(cfg, "max_position_embeddings")),
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,
        "init_method_std": float(cfg.get("initializer_range", 0.02)),
        **_moe_args(cfg, num_layers),
    }


def _dense_prefix(freq: Any, num_layers: int) -> int:
    pattern = [1 if i % freq == 0 else 0 for i in range(num_layers)] if isinstance(freq, int) \
        else list(freq)  # fmt: skip
    dense = pattern.index(1) if 1 in pattern else num_layers
    if pattern != [0] * dense + [1] * (num_layers - dense):
        raise ValueError(
            f"Megatron arg moe_layer_freq={freq!r} cannot be exported as deepseek_v3: its dense "
            "layers must come first (first_k_dense_replace)"
        )
    return dense


def hf_config_from_megatron_args(args: Any, base: dict | None = None) -> dict[str, Any]:
    """A deepseek_v3 `config.json` dict for `args`, in the hub spelling SGLang and transformers
    4 and 5 read (`rope_scaling`, `scoring_func`, `topk_method`)."""
    get = get_arg
    for key, wanted in (
        ("multi_latent_attention", True), ("swiglu", True), ("normalization", "RMSNorm"),
        ("position_embedding_type", "rope"), ("add_bias_linear", False), ("qk_layernorm", True),
        ("rotary_percent", 1.0), ("moe_router_score_function", "sigmoid"),
        ("moe_router_enable_expert_bias", True),
    ):  # fmt: skip
        expect_arg(args, key, wanted, "deepseek_v3")
    num_layers, heads = int(get(args, "num_layers")), int(get(args, "num_attention_heads"))
    moe_ffn = int(get(args, "moe_ffn_hidden_size"))
    shared = get(args, "moe_shared_expert_intermediate_size") or 0
    if shared % moe_ffn:
        raise ValueError(
            f"Megatron arg moe_shared_expert_intermediate_size={shared} cannot be exported as "
            f"deepseek_v3: must be a multiple of moe_ffn_hidden_size={moe_ffn}"
        )
    groups = get(args, "moe_router_num_groups") or 1
    rope = None
    if get(args, "rope_type", "yarn") == "yarn":
        rope = {
            "type": "yarn", "rope_type": "yarn",
            "factor": float(get(args, "rotary_scaling_factor")),
            "original_max_position_embeddings": int(get(args, "original_max_position_embeddings")),
            "beta_fast": float(get(args, "beta_fast")), "beta_slow": float(get(args, "beta_slow")),
            "mscale": float(get(args, "mscale")),
            "mscale_all_dim": float(get(args, "mscale_all_dim")),
        }  # fmt: skip
    elif float(get(args, "rotary_scaling_factor", 1.0)) != 1.0:
        raise ValueError("Megatron arg rotary_scaling_factor != 1 with rope_type 'rope' cannot "
                         "be exported as deepseek_v3 (its MLA softmax scale would differ)")
    q_lora = get(args, "q_lora_rank")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES["deepseek_v3"]],
        "model_type": "deepseek_v3",
        "vocab_size": int(get(args, "vocab_size")),
        "hidden_size": int(get(args, "hidden_size")),
        "intermediate_size": int(get(args, "ffn_hidden_size")),
        "moe_intermediate_size": moe_ffn,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": shared // moe_ffn,
        "n_routed_experts": int(get(args, "num_experts")),
        "num_experts_per_tok": int(get(args, "moe_router_topk")),
        "routed_scaling_factor": float(get(args, "moe_router_topk_scaling_factor") or 1.0),
        "n_group": int(groups),
        "topk_group": int(get(args, "moe_router_group_topk") or 1),
        "first_k_dense_replace": _dense_prefix(get(args, "moe_layer_freq", 1), num_layers),
        "num_nextn_predict_layers": int(get(args, "mtp_num_layers") or 0),  # MTP (`models.names`)
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(get(args, "kv_lora_rank")),
        "qk_nope_head_dim": int(get(args, "qk_head_dim")),
        "qk_rope_head_dim": int(get(args, "qk_pos_emb_head_dim")),
        "v_head_dim": int(get(args, "v_head_dim")),
        "rope_interleave": True,
        "hidden_act": "silu",
        "max_position_embeddings": int(get(args, "max_position_embeddings")),
        "rms_norm_eps": float(get(args, "norm_epsilon", 1e-6)),
        "rope_theta": float(get(args, "rotary_base", 10000.0)),
        "rope_scaling": rope,
        "tie_word_embeddings": not get(args, "untie_embeddings_and_output_weights", True),
        "attention_bias": False,
        "attention_dropout": float(get(args, "attention_dropout", 0.0)),
        "initializer_range": float(get(args, "init_method_std", 0.02)),
    }
    return with_base(cfg, base)
