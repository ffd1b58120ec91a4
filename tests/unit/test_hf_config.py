"""Contract of `models.hf_config`: HF config.json <-> Megatron args for the four families.

Reference values come from `transformers` config classes (the dicts they serialise) and, for the
Qwen3-MoE router, from running transformers' `Qwen3MoeTopKRouter` next to megatron-core's own
`topk_routing_with_score_function` with the flags we derive. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_async_rl.models.hf_config import (
    hf_config_from_megatron_args,
    legacy_compatible,
    megatron_args_from_hf,
)

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def hf_dict(family: str, **overrides) -> dict:
    kwargs = {**SMALL, **(MOE if family == "qwen3_moe" else {}), **overrides}
    return CLASSES[family](**kwargs).to_dict()


def test_llama_args_match_the_config():
    args = megatron_args_from_hf(hf_dict("llama", tie_word_embeddings=True))
    assert args == {
        "num_layers": 3,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "group_query_attention": True,
        "num_query_groups": 2,
        "kv_channels": 16,
        "swiglu": True,
        "normalization": "RMSNorm",
        "norm_epsilon": 1e-5,
        "position_embedding_type": "rope",
        "rotary_base": 500000.0,
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": False,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "vocab_size": 96,
        "max_position_embeddings": 256,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "init_method_std": 0.02,
    }


@pytest.mark.parametrize(
    ("family", "qkv_bias", "qk_norm"),
    [("qwen2", True, False), ("qwen3", False, True), ("qwen3_moe", False, True)],
)
def test_family_switches(family, qkv_bias, qk_norm):
    args = megatron_args_from_hf(hf_dict(family))
    assert (args["add_qkv_bias"], args["qk_layernorm"]) == (qkv_bias, qk_norm)
    assert args["untie_embeddings_and_output_weights"] is True
    assert ("num_experts" in args) == (family == "qwen3_moe")


def test_legacy_rope_theta_spelling_and_mha_default():
    cfg = {**hf_dict("llama"), "rope_theta": 1234.0, "rope_scaling": None}
    del cfg["rope_parameters"], cfg["num_key_value_heads"]
    args = megatron_args_from_hf(cfg)
    assert args["rotary_base"] == 1234.0
    assert (args["num_query_groups"], args["group_query_attention"]) == (4, False)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_router_matches_megatron_routing(norm_topk_prob):
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    hf_cfg = hf_dict("qwen3_moe", norm_topk_prob=norm_topk_prob)
    args = megatron_args_from_hf(hf_cfg)
    assert args["num_experts"] == 8 and args["moe_ffn_hidden_size"] == 32
    assert args["moe_router_pre_softmax"] is (not norm_topk_prob)
    torch.manual_seed(0)
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
        transformers.Qwen3MoeConfig(**hf_cfg)
    )
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(32, 64)
    logits, hf_weights, hf_index = router(hidden)
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits,
        args["moe_router_topk"],
        use_pre_softmax=args["moe_router_pre_softmax"],
        scaling_factor=args["moe_router_topk_scaling_factor"],
        score_function=args["moe_router_score_function"],
    )
    expected = torch.zeros_like(probs).scatter(1, hf_index, hf_weights)
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("llama", {"model_type": "gpt2"}, "model_type='gpt2'"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "llama3"),
        ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear"}}, "rope_scaling"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("qwen2", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ("qwen3_moe", {"num_experts_per_tok": 1}, "norm_topk_prob=True"),
        ("qwen3", {"num_key_value_heads": None}, "num_key_value_heads"),
    ],
)
def test_unsupported_configs_raise(family, change, match):
    cfg = {**hf_dict(family), **change}
    with pytest.raises(ValueError, match=match):
        megatron_args_from_hf(cfg)


@pytest.mark.parametrize("family", list(CLASSES))
@pytest.mark.parametrize("tie", [False, True])
def test_export_config_describes_the_same_model(family, tie):
    source = hf_dict(family, tie_word_embeddings=tie, eos_token_id=2, dtype="bfloat16")
    exported = hf_config_from_megatron_args(megatron_args_from_hf(source), family, base=source)
    assert exported["rope_theta"] == 500000.0 and exported["eos_token_id"] == 2
    assert exported["torch_dtype"] == exported["dtype"] == "bfloat16"
    a, b = CLASSES[family](**source), CLASSES[family](**exported)
    fields = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "rope_parameters",
    ]  # fmt: skip
    if family == "qwen3_moe":
        fields += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
    assert {f: getattr(b, f) for f in fields} == {f: getattr(a, f) for f in fields}
    assert megatron_args_from_hf(exported) == megatron_args_from_hf(source)


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("llama", {"swiglu": False}, "swiglu=False"),
        ("llama", {"qk_layernorm": True}, "qk_layernorm=True"),
        ("qwen2", {"add_qkv_bias": False}, "add_qkv_bias=False"),
        ("llama", {"num_experts": 4}, "only qwen3_moe"),
        ("qwen3_moe", {"moe_router_topk_scaling_factor": 2.5}, "scaling_factor=2.5"),
        ("qwen3_moe", {"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq=\\[1, 0, 1\\]"),
        ("llama", {"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ],
)
def test_unexportable_args_raise(family, change, match):
    args = {**megatron_args_from_hf(hf_dict(family)), **change}
    with pytest.raises(ValueError, match=match):
        hf_config_from_megatron_args(args, family)


def test_legacy_compatible_adds_classic_keys_transformers_still_reads():
    cfg = legacy_compatible(hf_dict("qwen3_moe"))
    assert cfg["num_experts"] == 8 and cfg["rope_theta"] == 500000.0
    reloaded = transformers.Qwen3MoeConfig(**cfg)
    assert reloaded.num_experts == 8
    assert reloaded.rope_parameters["rope_theta"] == 500000.0


DEEPSEEK = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
    routed_scaling_factor=2.5, max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 64},
)  # fmt: skip


def test_deepseek_v3_args_match_the_config():
    args = megatron_args_from_hf(transformers.DeepseekV3Config(**DEEPSEEK).to_dict())
    assert args["multi_latent_attention"] and args["qk_layernorm"]
    assert (args["q_lora_rank"], args["kv_lora_rank"], args["qk_head_dim"],
            args["qk_pos_emb_head_dim"], args["v_head_dim"]) == (24, 32, 16, 8, 16)  # fmt: skip
    assert args["moe_layer_freq"] == [0, 1, 1]
    assert args["moe_shared_expert_intermediate_size"] == 64  # 2 shared experts of 32
    assert (args["moe_router_score_function"], args["moe_router_enable_expert_bias"],
            args["moe_router_num_groups"], args["moe_router_group_topk"],
            args["moe_router_topk_scaling_factor"]) == ("sigmoid", True, 4, 2, 2.5)  # fmt: skip
    assert (args["rope_type"], args["rotary_scaling_factor"], args["mscale"],
            args["mscale_all_dim"], args["original_max_position_embeddings"]) == (
        "yarn", 40.0, 1.0, 0.707, 64)  # fmt: skip
    plain = megatron_args_from_hf(transformers.DeepseekV3Config(
        **{**DEEPSEEK, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "q_lora_rank": None, "n_group": 1, "topk_group": 1}).to_dict())  # fmt: skip
    # the MLA softmax scale reads the scaling factor whatever the rope type: 1 for plain RoPE
    assert (plain["rope_type"], plain["rotary_scaling_factor"], plain["mscale_all_dim"]) == (
        "rope", 1.0, 0.0)  # fmt: skip
    assert plain["q_lora_rank"] is None and plain["moe_router_num_groups"] is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"topk_group": 1}, "topk_group=1.*top 2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
         "rope_parameters.mscale=None"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0}}, "'default' or 'yarn'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config='fp8'.*"
         "dequantize it first"),
    ],
)  # fmt: skip
def test_deepseek_v3_unsupported_configs_raise(change, match):
    cfg = {**transformers.DeepseekV3Config(**DEEPSEEK).to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        megatron_args_from_hf(cfg)


def test_deepseek_v3_export_describes_the_same_model():
    source = transformers.DeepseekV3Config(**DEEPSEEK, eos_token_id=2).to_dict()
    args = megatron_args_from_hf(source)
    exported = hf_config_from_megatron_args(args, "deepseek_v3", base=source)
    assert exported["eos_token_id"] == 2 and exported["topk_method"] == "noaux_tc"
    assert megatron_args_from_hf(exported) == args
    reread = transformers.DeepseekV3Config(**exported)  # transformers reads the hub spelling
    assert reread.rope_parameters["rope_type"] == "yarn" and reread.first_k_dense_replace == 1
    assert megatron_args_from_hf(legacy_compatible(reread.to_dict())) == args
    with pytest.raises(ValueError, match="dense layers must come first"):
        hf_config_from_megatron_args({**args, "moe_layer_freq": [1, 0, 1]}, "deepseek_v3")
    with pytest.raises(ValueError, match="multi_latent_attention=True cannot be exported as llama"):
        hf_config_from_megatron_args(args, "llama")
