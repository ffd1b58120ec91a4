"""HuggingFace `config.json` <-> Megatron-LM model arguments, for the four supported families.

Owns the architectural translation only: which Megatron arg (argparse dest name, e.g.
`num_query_groups`) a HF config key becomes, and the inverse used when exporting. Called by the
model builder (`megatron_args_from_hf` before building a `GPTModel` from a HF directory) and by
export / `tiny.py` (`hf_config_from_megatron_args`, `legacy_compatible`). Pure Python.

Families: `llama`, `qwen2` (q/k/v bias), `qwen3` (per-head q/k RMSNorm), `qwen3_moe` (all layers
MoE, no shared expert), `deepseek_v3` (DeepSeek-V3/R1, Kimi-K2, Moonlight: multi-latent attention,
dense first layers, MoE with shared experts and sigmoid group-limited routing with an expert bias).
Anything the Megatron model would compute differently raises `ValueError`
naming the key, the value and the rule: better no model than a silently different one.

Qwen3-MoE routing (transformers 5.12.1 `Qwen3MoeTopKRouter`): `p = softmax(logits)` over all
experts in fp32, top-k of `p`, then `p_topk /= p_topk.sum()` if `norm_topk_prob`. Megatron-core
0.16.1 `topk_routing_with_score_function` (softmax score function, no scaling factor) computes
- `moe_router_pre_softmax=True`: softmax over all experts, then top-k, no renormalisation, which is
  HF with `norm_topk_prob=False`;
- `moe_router_pre_softmax=False`: top-k of the raw logits, then softmax over those k logits. Since
  softmax is monotone the same experts win, and `exp(l_i) / sum_topk exp(l_j)` equals the
  renormalised full softmax: HF with `norm_topk_prob=True`.
Megatron rejects `pre_softmax=False` with top-1, where HF would give every token weight 1.0, so
that combination raises here.
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

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")



def rope_theta(hf_config: dict) -> float:
    """The RoPE base, from `rope_parameters` (transformers 5) or `rope_theta` (older files).

    Only plain RoPE is supported: any `rope_type` other than `default` (llama3, yarn, linear, ...)
    or a partial rotary factor would make Megatron rotate differently.
    """
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise unsupported("rope_parameters.rope_type", rope_type, "only 'default' RoPE")
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise unsupported("rope_parameters.partial_rotary_factor", factor, "must be 1.0")
        return float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    scaling = hf_config.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "default":
            raise unsupported("rope_scaling", scaling, "only plain RoPE (rope_scaling null)")
    return float(hf_config.get("rope_theta", 10000.0))


def _check_attention(cfg: dict, model_type: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", cfg["hidden_act"], "only 'silu' (SwiGLU)")
    if cfg.get("use_sliding_window", False):
        raise unsupported("use_sliding_window", True, "sliding-window attention is not built")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise unsupported("layer_types", layer_types, "every layer must be 'full_attention'")
    if cfg.get("mlp_bias", False):
        raise unsupported("mlp_bias", True, "MLP biases are not built (add_bias_linear=False)")
    if model_type != "qwen2" and cfg.get("attention_bias", False):
        # In llama/qwen3 this also puts a bias on o_proj, which only add_bias_linear could
        # express, and that flag would add MLP biases as well.
        raise unsupported("attention_bias", True, f"{model_type} with o_proj bias")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise unsupported("pretraining_tp", cfg["pretraining_tp"], "must be 1")


def _moe_args(cfg: dict) -> dict[str, Any]:
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not num_experts:
        raise ValueError("HF config (model_type='qwen3_moe') lacks num_experts (> 0)")
    if cfg.get("mlp_only_layers"):
        raise unsupported("mlp_only_layers", cfg["mlp_only_layers"], "every layer must be MoE")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise unsupported(
            "decoder_sparse_step",
            cfg["decoder_sparse_step"],
            "must be 1 (every layer MoE)",
        )
    top_k = int(require(cfg, "num_experts_per_tok"))
    norm_topk = bool(cfg.get("norm_topk_prob", False))
    if norm_topk and top_k == 1:
        raise unsupported(
            "norm_topk_prob",
            True,
            "with num_experts_per_tok=1 Megatron cannot renormalise",
        )
    return {
        "num_experts": int(num_experts),
        "moe_router_topk": top_k,
        "moe_ffn_hidden_size": int(require(cfg, "moe_intermediate_size")),
        "moe_layer_freq": 1,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not norm_topk,
        "moe_router_topk_scaling_factor": None,
    }


def megatron_args_from_hf(hf_config: dict) -> dict[str, Any]:
    """Megatron-LM arg dest names -> values describing the same network as `hf_config`."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported("model_type", model_type, f"supported: {SUPPORTED_MODEL_TYPES}")
    if model_type == "deepseek_v3":
        from megatron_async_rl.models import hf_deepseek

        return hf_deepseek.megatron_args_from_hf(hf_config)
    _check_attention(hf_config, model_type)
    hidden = int(require(hf_config, "hidden_size"))
    num_heads = int(require(hf_config, "num_attention_heads"))
    if model_type == "llama":
        num_groups = int(hf_config.get("num_key_value_heads") or num_heads)
    else:
        num_groups = int(require(hf_config, "num_key_value_heads"))
    # Mirrors transformers: Qwen3Config defaults head_dim to 128, the others derive it.
    default_head_dim = 128 if model_type == "qwen3" else hidden // num_heads
    head_dim = int(hf_config.get("head_dim") or default_head_dim)
    args: dict[str, Any] = {
        "num_layers": int(require(hf_config, "num_hidden_layers")),
        "hidden_size": hidden,
        "ffn_hidden_size": int(require(hf_config, "intermediate_size")),
        "num_attention_heads": num_heads,
        "group_query_attention": num_groups != num_heads,
        "num_query_groups": num_groups,
        "kv_channels": head_dim,
        "swiglu": True,
        "normalization": "RMSNorm",
        "norm_epsilon": float(hf_config.get("rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope",
        "rotary_base": rope_theta(hf_config),
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not hf_config.get("tie_word_embeddings", False),
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2",
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),
        "vocab_size": int(require(hf_config, "vocab_size")),
        "max_position_embeddings": int(require(hf_config, "max_position_embeddings")),
        "attention_dropout": float(hf_config.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,
        "init_method_std": float(hf_config.get("initializer_range", 0.02)),
    }
    if model_type == "qwen3_moe":
        args.update(_moe_args(hf_config))
    return args


def hf_config_from_megatron_args(
    args: Any, model_type: str, base: dict | None = None
) -> dict[str, Any]:
    """A `config.json` dict for `args` (a dict or argparse Namespace) as `model_type`.

    Written in the classic hub spelling (`rope_theta`, `num_experts`), which transformers 4 and
    5 and SGLang all read. `base` (the source model's config) contributes token ids and dtype
    (written as both `torch_dtype` and `dtype`); it must match the exported tensors.
    """
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported("model_type", model_type, f"supported: {SUPPORTED_MODEL_TYPES}")
    if model_type == "deepseek_v3":
        from megatron_async_rl.models import hf_deepseek

        return hf_deepseek.hf_config_from_megatron_args(args, base)
    for key, wanted in (
        ("multi_latent_attention", False),
        ("swiglu", True),
        ("normalization", "RMSNorm"),
        ("position_embedding_type", "rope"),
        ("add_bias_linear", False),
        ("rotary_percent", 1.0),
        ("rotary_interleaved", False),
        ("add_qkv_bias", model_type == "qwen2"),
        ("qk_layernorm", model_type in ("qwen3", "qwen3_moe")),
    ):
        expect_arg(args, key, wanted, model_type)
    num_heads = int(get_arg(args, "num_attention_heads"))
    hidden = int(get_arg(args, "hidden_size"))
    groups = get_arg(args, "num_query_groups") if get_arg(args, "group_query_attention") else None
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": int(get_arg(args, "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(get_arg(args, "ffn_hidden_size")),
        "num_hidden_layers": int(get_arg(args, "num_layers")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(groups or num_heads),
        "head_dim": int(get_arg(args, "kv_channels") or hidden // num_heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(get_arg(args, "max_position_embeddings")),
        "rms_norm_eps": float(get_arg(args, "norm_epsilon", 1e-5)),
        "rope_theta": float(get_arg(args, "rotary_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": not get_arg(args, "untie_embeddings_and_output_weights", True),
        "attention_dropout": float(get_arg(args, "attention_dropout", 0.0)),
        "initializer_range": float(get_arg(args, "init_method_std", 0.02)),
    }
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if model_type == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg["use_sliding_window"] = False
    if model_type == "qwen3_moe":
        expect_arg(args, "moe_router_score_function", "softmax", model_type)
        expect_arg(args, "moe_router_topk_scaling_factor", None, model_type)
        freq = get_arg(args, "moe_layer_freq", 1)
        if freq != 1 and not (isinstance(freq, list) and set(freq) == {1}):
            raise ValueError(
                f"Megatron arg moe_layer_freq={freq!r}: qwen3_moe needs all layers MoE"
            )
        cfg.update(
            num_experts=int(get_arg(args, "num_experts")),
            num_experts_per_tok=int(get_arg(args, "moe_router_topk")),
            moe_intermediate_size=int(get_arg(args, "moe_ffn_hidden_size")),
            norm_topk_prob=not get_arg(args, "moe_router_pre_softmax", False),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif get_arg(args, "num_experts"):
        raise ValueError(
            f"Megatron arg num_experts={get_arg(args, 'num_experts')!r} cannot be exported as "
            f"{model_type}: only qwen3_moe has experts"
        )
    return with_base(cfg, base)


def export_base(base: dict, mtp_num_layers: int) -> dict[str, Any]:
    """The source model's config `base` as a train role's HF export writes it: a deepseek_v3
    one says how many multi-token-prediction layers the export carries
    (`num_nextn_predict_layers`: --mtp-num-layers, `models.names`; 0 without)."""
    if base.get("model_type") == "deepseek_v3":
        return {**base, "num_nextn_predict_layers": mtp_num_layers}
    return base


def legacy_compatible(hf_config: dict) -> dict[str, Any]:
    """Adds classic spellings transformers 5 stopped writing: rope_theta, num_experts, torch_dtype.

    transformers 5 writes `rope_parameters` and `num_local_experts`; an older transformers (as
    SGLang may pin) ignores both and would silently fall back to class defaults (128 experts).
    """
    cfg = dict(hf_config)
    if cfg.get("model_type") == "deepseek_v3":
        # transformers 5 writes neither: its DeepseekV3 routes by sigmoid with the expert bias
        # ("noaux_tc") always, while SGLang reads the keys (greedy softmax routing without them)
        cfg.setdefault("scoring_func", "sigmoid")
        cfg.setdefault("topk_method", "noaux_tc")
        cfg.setdefault("moe_layer_freq", 1)  # DeepSeek's own key, read by SGLang
        params = cfg.get("rope_parameters") or {}
        rope_type = params.get("rope_type", "default")
        if rope_type != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {"type": rope_type, **{k: v for k, v in params.items()
                                                           if k != "rope_theta"}}  # fmt: skip
        cfg.setdefault("rope_theta", float(params.get("rope_theta", 10000.0)))
        return {**cfg, **({"torch_dtype": cfg["dtype"]} if "dtype" in cfg else {})}
    cfg.setdefault("rope_theta", rope_theta(hf_config))
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    if "num_local_experts" in cfg:
        cfg.setdefault("num_experts", cfg["num_local_experts"])
    return cfg
