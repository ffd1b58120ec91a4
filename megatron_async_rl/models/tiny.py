"""Tiny, locally made HF model directories (llama, qwen2, qwen3, qwen3_moe, deepseek_v3) for tests.

Owns `write_tiny_model` and its command line:

    python -m megatron_async_rl.models.tiny --family llama --out runs/tiny-llama [--seed 0]
        [--task causal_lm|sequence_classification|token_classification]

The weights come from `transformers` itself (random init under `seed`, fp32, safetensors); the
tokenizer is built here with `tokenizers` (one token per character of an arithmetic alphabet,
plus specials and a chat template), so nothing is downloaded. Used by unit, distributed and e2e
tests and by the CPU recipes. The init is deliberately not the transformers default: a larger
`initializer_range` and random norm weights and biases make layout mistakes (q/k norms swapped,
a mis-interleaved bias) change the logits visibly in parity tests. Besides causal LMs, llama,
qwen2 and qwen3 come as a reward model (`*ForSequenceClassification`) or a critic
(`*ForTokenClassification`) with one label (`task`), for the scalar heads of `models.heads`.
A deepseek_v3 model can carry multi-token-prediction layers (`num_mtp_layers`), which
transformers neither builds nor loads: written here in DeepSeek-V3's hub layout.
"""

from __future__ import annotations

import argparse
import json
import logging
import string
from pathlib import Path
from typing import Any

import torch

from megatron_async_rl.models.hf_config import legacy_compatible

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
# task -> the transformers Auto class that makes it; the classification ones with num_labels=1.
TASKS = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
}
CLASSIFICATION_FAMILIES = ("llama", "qwen2", "qwen3")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
CHARACTERS = (
    string.digits + "+-*/=?.,:;()!'\"%<>" + string.ascii_lowercase + string.ascii_uppercase + " \n"
    + "{}[]_|"  # JSON tool calls (`<tool_call>{...}</tool_call>`); appended: ids above unchanged
)
TOOL_ROLE_TOKEN = "<|tool|>"
"""The chat template's tool-message header, one special token (after the characters)."""
# The vocab is filled with reserved tokens up to a multiple of this, so that TP=2/4 split it
# evenly and every id the model can sample decodes to something.
VOCAB_MULTIPLE = 16
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<eos>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Any:
    """A character-level `PreTrainedTokenizerFast`; its length is a multiple of 16."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS) + [TOOL_ROLE_TOKEN]
    num_reserved = -len(tokens) % VOCAB_MULTIPLE
    reserved = [f"<|reserved_{i}|>" for i in range(num_reserved)]
    tokens += reserved
    vocab = {token: i for i, token in enumerate(tokens)}
    # BPE without merges over single characters: each character is one token, unknown ones <unk>.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS) + [TOOL_ROLE_TOKEN] + reserved)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def _config(family: str, vocab_size: int, overrides: dict[str, Any]) -> Any:
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[family]
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "initializer_range": 0.1,
        "pad_token_id": SPECIAL_TOKENS.index("<pad>"),
        "bos_token_id": SPECIAL_TOKENS.index("<bos>"),
        "eos_token_id": SPECIAL_TOKENS.index("<eos>"),
    }
    if family == "qwen3_moe":
        kwargs.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    if family == "deepseek_v3":
        # MLA (query LoRA, shared rope key), one dense layer then MoE with a shared expert and
        # sigmoid routing over 2 groups (top-2 = 2 x topk_group, see hf_deepseek)
        kwargs.update(
            num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            # YaRN as DeepSeek's checkpoints (SGLang's CPU MLA builds no other RoPE)
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        )  # fmt: skip
    unknown = sorted(k for k in overrides if k not in kwargs and not hasattr(cls(), k))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) in overrides: {unknown}")
    kwargs.update(overrides)
    if family != "deepseek_v3":  # its head_dim is the rope head size, set by the config
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    return cls(**kwargs)


def write_tiny_model(
    out_dir: str | Path, family: str, seed: int = 0, task: str = "causal_lm",
    num_mtp_layers: int = 0, **overrides: Any,
) -> Path:  # fmt: skip
    """Writes a tiny `family` model, its tokenizer and config to `out_dir`; returns the path.

    `overrides` are config fields (e.g. `hidden_size=32`, `tie_word_embeddings=True`). `task`
    (`TASKS`): a causal LM, or with one label (`score` head, pad_token_id set) a sequence
    classifier (reward model) or a token classifier (critic), for `CLASSIFICATION_FAMILIES`.
    `num_mtp_layers` (deepseek_v3 only): DeepSeek-V3 multi-token-prediction layers
    (`num_nextn_predict_layers`), randomly initialised (`_write_mtp_layers`).
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {tuple(TASKS)}")
    if task != "causal_lm" and family not in CLASSIFICATION_FAMILIES:
        raise ValueError(f"task={task!r} is written for {CLASSIFICATION_FAMILIES}, not {family!r}")
    if num_mtp_layers and family != "deepseek_v3":
        raise ValueError(f"num_mtp_layers={num_mtp_layers}: only deepseek_v3 names MTP layers")
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = _config(family, len(tokenizer), overrides)
    if task != "causal_lm":
        config.num_labels = 1
    torch.manual_seed(seed)
    model = getattr(transformers, TASKS[task]).from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the routing bias counts in routing
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    make_loadable_everywhere(out)
    if num_mtp_layers:
        _write_mtp_layers(out, config, num_mtp_layers, generator)
    logger.info("wrote tiny %s model to %s", family, out)
    return out


def _write_mtp_layers(out: Path, config: Any, num_layers: int, generator) -> None:
    """Adds DeepSeek-V3's MTP layers to `out`'s weights: layer i is `model.layers.{L + i}`
    (L = num_hidden_layers), a decoder layer (transformers' own, so MoE past
    first_k_dense_replace) with `enorm`, `hnorm`, `eh_proj` [h, 2h] and `shared_head.norm`,
    plus copies of the embedding and the LM head (`embed_tokens`, `shared_head.head`); and
    `num_nextn_predict_layers` to config.json. Norms as `write_tiny_model`'s, matrices
    N(0, initializer_range^2)."""
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from megatron_async_rl.models.hf_checkpoint import WEIGHTS_FILE, to_hub_layout

    path = out / WEIGHTS_FILE
    tensors = load_file(str(path))
    h, std, first = config.hidden_size, config.initializer_range, config.num_hidden_layers
    head = tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]

    def rand(shape, name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.rand(shape, generator=generator) + 0.5
        if name.endswith("e_score_correction_bias"):
            return torch.randn(shape, generator=generator) * 0.1
        return torch.randn(shape, generator=generator) * std

    for i in range(num_layers):
        prefix = f"model.layers.{first + i}."
        layer = DeepseekV3DecoderLayer(config, first + i).state_dict()
        own = {name: rand(t.shape, name) for name, t in layer.items()}
        own.update({name: rand(shape, name) for name, shape in (
            ("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
            ("shared_head.norm.weight", (h,)))})  # fmt: skip
        own["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        own["shared_head.head.weight"] = head.clone()
        tensors.update(to_hub_layout({prefix + name: t for name, t in own.items()}))
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config["num_nextn_predict_layers"] = num_layers
    config_path.write_text(json.dumps(hf_config, indent=2))


def make_loadable_everywhere(out: Path) -> None:
    """Adds classic config keys and a tokenizer class name older transformers know too.

    transformers 5 writes `rope_parameters`, `num_local_experts` and `TokenizersBackend`; an
    older transformers (as SGLang may pin) would not read them, silently in the first two cases.
    """
    config_path = out / "config.json"
    config = legacy_compatible(json.loads(config_path.read_text()))
    config_path.write_text(json.dumps(config, indent=2))
    tok_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok_config, indent=2))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=tuple(TASKS), default="causal_lm")
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument(
        "--tie", action=argparse.BooleanOptionalAction, default=False, help="tie embeddings"
    )
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {"tie_word_embeddings": args.tie}
    if args.hidden_size is not None:
        overrides["hidden_size"] = args.hidden_size
    if args.num_layers is not None:
        overrides["num_hidden_layers"] = args.num_layers
    return write_tiny_model(args.out, args.family, seed=args.seed, task=args.task, **overrides)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
