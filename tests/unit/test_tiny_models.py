"""Contract of `models.tiny` and `models.hf_checkpoint`: local HF directories that load offline.

Every family's tiny directory loads with `AutoModelForCausalLM` / `AutoTokenizer` with the hub
switched off; the character tokenizer round-trips arithmetic; an export through Megatron names
(`hf_to_megatron` -> `megatron_to_hf` -> `save_hf_checkpoint`) reloads in transformers with the
same logits; `to_hub_layout` matches what transformers itself writes for fused Qwen3-MoE experts;
reading errors name the path. Nothing is faked.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

# Local directories never reach the hub; this guards against a regression when run alone.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from megatron_async_rl.models.dims import ModelDims  # noqa: E402
from megatron_async_rl.models.hf_checkpoint import (  # noqa: E402
    load_hf_state_dict,
    read_hf_config,
    save_hf_checkpoint,
    to_hub_layout,
)
from megatron_async_rl.models.hf_config import (  # noqa: E402
    hf_config_from_megatron_args,
    megatron_args_from_hf,
)
from megatron_async_rl.models.names import hf_to_megatron, megatron_to_hf  # noqa: E402
from megatron_async_rl.models.tiny import FAMILIES, main, write_tiny_model  # noqa: E402

PROMPT = torch.tensor([[1, 8, 9, 17, 14, 21, 8, 16, 2]])


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {f: write_tiny_model(tmp_path_factory.mktemp(f), f, seed=3) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_offline(tiny_dirs, family):
    path = tiny_dirs[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == family
    assert model.config.vocab_size == len(tokenizer) == 96
    assert model.dtype == torch.float32
    logits = model(PROMPT).logits
    assert logits.shape == (1, PROMPT.shape[1], 96) and torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not the near-uniform logits of a default 0.02 init
    config = read_hf_config(path)
    # Classic spellings for an older transformers (as SGLang may pin).
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "float32"
    if family == "qwen3_moe":
        assert config["num_experts"] == 4 and model.config.num_experts == 4


def test_tokenizer_round_trips_arithmetic(tiny_dirs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    ids = tokenizer("12+7=19")["input_ids"]
    assert len(ids) == 7 and tokenizer.decode(ids) == "12+7=19"
    assert tokenizer.decode(tokenizer("What is 3*4? 12.\n")["input_ids"]) == "What is 3*4? 12.\n"
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>"]) == [0, 1, 2]
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|>1+1?<eos><|assistant|>"
    assert tokenizer.decode(tokenizer("a~b")["input_ids"]) == "a<unk>b"


def test_seed_decides_the_weights(tmp_path):
    a = load_hf_state_dict(write_tiny_model(tmp_path / "a", "qwen2", seed=5))
    b = load_hf_state_dict(write_tiny_model(tmp_path / "b", "qwen2", seed=5))
    c = load_hf_state_dict(write_tiny_model(tmp_path / "c", "qwen2", seed=6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


def test_command_line(tmp_path):
    out = main(["--family", "qwen3", "--out", str(tmp_path), "--hidden-size", "32",
                "--num-layers", "3", "--tie", "--seed", "1"])  # fmt: skip
    config = read_hf_config(out)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 3)
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 8
    assert "lm_head.weight" not in load_hf_state_dict(out)


def test_bad_family_or_override(tmp_path):
    with pytest.raises(ValueError, match="family='gpt2'"):
        write_tiny_model(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="unknown LlamaConfig field\\(s\\) in overrides"):
        write_tiny_model(tmp_path, "llama", hiden_size=8)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_export_through_megatron_names_keeps_logits(tiny_dirs, tmp_path, family):
    src = tiny_dirs[family]
    hf_config = read_hf_config(src)
    args = megatron_args_from_hf(hf_config)
    dims = ModelDims.from_megatron_args(args)
    mc_sd = hf_to_megatron(load_hf_state_dict(src), dims)
    exported = hf_config_from_megatron_args(args, family, base=hf_config)
    out = save_hf_checkpoint(tmp_path / "export", megatron_to_hf(mc_sd, dims), exported, src)
    reference = transformers.AutoModelForCausalLM.from_pretrained(src)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded(PROMPT).logits, reference(PROMPT).logits)
    assert transformers.AutoTokenizer.from_pretrained(out).decode([8, 17]) == "1+"
    with open(out / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == 2


def test_to_hub_layout_matches_what_transformers_writes(tiny_dirs):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3_moe"])
    module_sd = model.state_dict()
    assert module_sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    hub = to_hub_layout(module_sd)
    on_disk = load_hf_state_dict(tiny_dirs["qwen3_moe"])
    assert hub.keys() == on_disk.keys()
    assert all(torch.equal(hub[k], on_disk[k]) for k in on_disk)


def test_sharded_directory_with_index(tmp_path, tiny_dirs):
    full = load_hf_state_dict(tiny_dirs["llama"])
    keys = sorted(full)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for file, names in halves.items():
        save_file({k: full[k] for k in names}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index decides")
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf_state_dict(tmp_path)
    assert loaded.keys() == full.keys() and all(torch.equal(loaded[k], full[k]) for k in full)
    weight_map["model.ghost"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match="lists tensors not found in its files: \\['model.ghost'\\]"
    ):
        load_hf_state_dict(tmp_path)
    with pytest.raises(ValueError, match="already holds other weights"):
        save_hf_checkpoint(tmp_path, full, {}, None)


def test_save_owns_views_and_shared_storage(tmp_path):
    base = torch.arange(12.0).reshape(4, 3)
    save_hf_checkpoint(tmp_path, {"a": base[:2], "b": base[2:], "c": base.t()}, {"x": 1}, None)
    loaded = load_hf_state_dict(tmp_path)
    assert torch.equal(loaded["b"], base[2:]) and torch.equal(loaded["c"], base.t())
    assert read_hf_config(tmp_path) == {"x": 1}


def test_reading_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        load_hf_state_dict(missing)
    with pytest.raises(ValueError, match="has no \\*.safetensors files"):
        load_hf_state_dict(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}.*has no config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        save_hf_checkpoint(tmp_path / "out", {}, {}, tmp_path / "empty")
    assert not (tmp_path / "out").exists()
