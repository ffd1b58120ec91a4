"""HF `config.json` contents of small models, for tests that write a config and no weights
(`tests/unit/test_upcycle.py`, `test_upcycle_recipe.py`)."""

QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "vocab_size": 96, "hidden_act": "silu", "initializer_range": 0.1, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
}  # fmt: skip
"""A dense Qwen3 of 2 layers, hidden size 64, FFN 128, 4 heads (2 KV groups)."""
