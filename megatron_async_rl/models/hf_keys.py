"""What the HF config translations share: the families' architecture names and the checks.

Owned here: `ARCHITECTURES` (model_type -> the `architectures` entry an export writes),
`unsupported` and `require` (a HF config key that cannot be built, or is missing: `ValueError`
naming it), `get_arg` and `expect_arg` (a Megatron arg read from a dict or a namespace, and one
an export needs at a given value) and `with_base` (the token ids and dtype carried over from the
source model's config). Used by `hf_config` (every family) and `hf_deepseek` (DeepSeek-V3),
which it lets share them without importing each other back. Pure Python.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Keys carried over from a source config on export: they describe tokens, not shapes.
PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def unsupported(key: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"unsupported HF config: {key}={value!r}; {rule}")


def require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(
            f"HF config (model_type={cfg.get('model_type')!r}) lacks required key {key!r}"
        )
    return cfg[key]


def get_arg(args: Any, key: str, default: Any = None) -> Any:
    if isinstance(args, dict):
        return args.get(key, default)
    return getattr(args, key, default)


def expect_arg(args: Any, key: str, wanted: Any, model_type: str) -> None:
    value = get_arg(args, key, wanted)
    if value != wanted:
        raise ValueError(
            f"Megatron arg {key}={value!r} cannot be exported as {model_type}: needs {wanted!r}"
        )


def with_base(cfg: dict[str, Any], base: dict | None) -> dict[str, Any]:
    """`cfg` with the token ids and the dtype of `base` (the source model's config)."""
    for key in PASSTHROUGH_KEYS:
        if base and key in base:
            cfg[key] = base[key]
    dtype = base and (base.get("torch_dtype") or base.get("dtype"))
    if dtype:
        cfg["torch_dtype"] = cfg["dtype"] = dtype
    return cfg
