"""Contract of scalar heads on the HF side (`models.heads`, `models.dims`, `models.names`,
`models.tiny`).

Checks: a value head's Megatron `output_layer.weight` / `.bias` are HF `score.weight` /
`score.bias` (a score head's only the weight), replicated over TP, on the last stage only; HF
token- and sequence-classification checkpoints written by `transformers` go HF -> Megatron -> HF
byte for byte; a critic started from a policy's causal-LM checkpoint gets a zero head with init
std 0 (the body is the policy's, its `lm_head` ignored), a seeded random one otherwise, and a
reward model's checkpoint (no bias) a zero bias; the pooling picks each row's last non-pad token
(indices worked out by hand); every user error is refused with a message naming the value.
Pure torch and safetensors, tiny checkpoints written by transformers; nothing is faked.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from megatron_async_rl.models import heads
from megatron_async_rl.models.dims import ModelDims, hf_shape
from megatron_async_rl.models.hf_checkpoint import (
    HFTensorReader,
    load_hf_state_dict,
    read_hf_config,
)
from megatron_async_rl.models.hf_config import megatron_args_from_hf
from megatron_async_rl.models.names import (
    check_hf_names,
    hf_names_for,
    hf_to_megatron,
    megatron_to_hf,
    shard_spec,
    stage_param_names,
)
from megatron_async_rl.models.shards import stage_state_dict, stage_state_dict_from_hf
from megatron_async_rl.models.tiny import write_tiny_model

TASKS = {"value": "token_classification", "score": "sequence_classification"}


def _dims(path, head: str | None) -> ModelDims:
    args = megatron_args_from_hf(read_hf_config(path))
    if head is None:
        return ModelDims.from_megatron_args(args)
    args["untie_embeddings_and_output_weights"] = True
    return dataclasses.replace(ModelDims.from_megatron_args(args), head=head)


def _load(path, dims, init_std=None, seed=0) -> dict:
    """What `weights.load_hf_into_megatron` gives one TP=1 rank, without a model."""
    reader = HFTensorReader(path)
    read, names = heads.head_reader(reader.read, reader.keys(), dims, init_std, seed, str(path))
    check_hf_names(names, dims)
    return stage_state_dict_from_hf(read, dims, reader.read_range)


@pytest.mark.parametrize("head", ["value", "score"])
def test_head_parameters_are_hf_score_replicated_on_the_last_stage(head, tiny_model):
    dims = _dims(tiny_model("llama", task=TASKS[head]), head)
    want = ["output_layer.weight"] + (["output_layer.bias"] if head == "value" else [])
    assert [n for n in stage_param_names(dims) if n.startswith("output_layer")] == want
    first, last = (stage_param_names(dims, pp_rank=r, pp_size=2) for r in (0, 1))
    assert not any(n.startswith("output_layer") for n in first)
    assert [n for n in last if n.startswith("output_layer")] == want
    for name in want:
        assert hf_names_for(name, dims) == ("score." + name.split(".")[1],)
        assert shard_spec(name, dims).partition_dim is None
    assert hf_shape("score.weight", dims) == (1, 64)
    if head == "score":
        with pytest.raises(ValueError, match="output_layer.bias.*score head"):
            hf_names_for("output_layer.bias", dims)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("head", ["value", "score"])
def test_classification_checkpoint_round_trips_byte_identical(head, family, tiny_model):
    path = tiny_model(family, task=TASKS[head])
    dims, hf_sd = _dims(path, head), load_hf_state_dict(path)
    assert "lm_head.weight" not in hf_sd
    mc = hf_to_megatron(hf_sd, dims)
    assert torch.equal(mc["output_layer.weight"], hf_sd["score.weight"])
    assert ("output_layer.bias" in mc) == (head == "value")
    back = megatron_to_hf(mc, dims)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], t) for k, t in hf_sd.items())
    for tp_rank in (0, 1):  # TP=2: each rank holds the whole head
        stage = stage_state_dict(mc, dims, tp_rank=tp_rank, tp_size=2)
        assert torch.equal(stage["output_layer.weight"], hf_sd["score.weight"])


def test_policy_checkpoint_starts_a_critic_with_a_zero_head(tiny_model):
    policy = tiny_model("llama")
    dims = _dims(policy, "value")
    local = _load(policy, dims, init_std=0.0)
    assert torch.equal(local["output_layer.weight"], torch.zeros(1, 64))
    assert torch.equal(local["output_layer.bias"], torch.zeros(1))
    body = hf_to_megatron(load_hf_state_dict(policy), _dims(policy, None))
    assert local.keys() == (body.keys() - {"output_layer.weight"}) | {
        "output_layer.weight", "output_layer.bias",
    }  # fmt: skip
    for name, tensor in body.items():
        if name != "output_layer.weight":  # the policy's lm_head is not loaded
            assert torch.equal(local[name], tensor), name


def test_random_initial_head_is_seeded_and_a_reward_model_keeps_its_weight(tiny_model):
    policy, reward = tiny_model("llama"), tiny_model("llama", task="sequence_classification")
    dims = _dims(policy, "value")
    a, b = (_load(policy, dims, 0.5, seed=1)["output_layer.weight"] for _ in range(2))
    c = _load(policy, dims, 0.5, seed=2)["output_layer.weight"]
    assert torch.equal(a, b) and not torch.equal(a, c) and a.abs().min() > 0
    from_reward = _load(reward, dims, 0.0)  # a critic started from the reward model
    reward_weight = load_hf_state_dict(reward)["score.weight"]
    assert torch.equal(from_reward["output_layer.weight"], reward_weight)
    assert torch.equal(from_reward["output_layer.bias"], torch.zeros(1))


def test_head_loading_errors(tiny_model, tmp_path):
    policy, reward = tiny_model("llama"), tiny_model("llama", task="sequence_classification")
    with pytest.raises(ValueError, match=r"has no \['score.weight', 'score.bias'\].*head_init_std"):
        _load(policy, _dims(policy, "value"))
    with pytest.raises(ValueError, match="head_init_std=-0.1: must be >= 0"):
        _load(policy, _dims(policy, "value"), init_std=-0.1)
    with pytest.raises(ValueError, match="has score.weight.*scalar head"):
        check_hf_names(HFTensorReader(reward).keys(), _dims(reward, None))
    two_labels = load_hf_state_dict(reward)
    two_labels["score.weight"] = torch.cat([two_labels["score.weight"]] * 2)
    save_file(two_labels, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((reward / "config.json").read_text())
    with pytest.raises(ValueError, match=r"score.weight has shape \(2, 64\).*num_labels=1"):
        _load(tmp_path, _dims(reward, "score"))


def test_head_kind_errors(tiny_model):
    dims = _dims(tiny_model("llama"), None)
    with pytest.raises(ValueError, match="head='critic' is not one of"):
        dataclasses.replace(dims, tied_embeddings=False, head="critic")
    with pytest.raises(ValueError, match="value head replaces the output layer: untie"):
        dataclasses.replace(dims, tied_embeddings=True, head="value")
    with pytest.raises(ValueError, match=r"head='reward' is not one of \('value', 'score'\)"):
        heads.check_kind("reward")


def test_last_non_pad_index_and_pooling():
    tokens = torch.tensor([[5, 6, 0, 0], [5, 0, 7, 0], [0, 0, 5, 6], [9, 9, 9, 9], [4, 0, 0, 0]])
    index = heads.last_non_pad_index(tokens, 0)  # right, inner, left, none, one token
    assert index.tolist() == [1, 2, 3, 3, 0]
    out = torch.arange(20.0).view(5, 4)
    assert heads.pool_last_non_pad(out, tokens, 0).tolist() == [1.0, 6.0, 11.0, 15.0, 16.0]
    with pytest.raises(ValueError, match=r"rows \[1\] hold only pad_id=0"):
        heads.last_non_pad_index(torch.tensor([[3, 0], [0, 0]]), 0)
    for bad in (None, True, 0.0):
        with pytest.raises(ValueError, match="the pad token id"):
            heads.last_non_pad_index(tokens, bad)


def test_tiny_classification_models(tiny_model, tmp_path):
    path = tiny_model("qwen3", task="token_classification")
    config, hf_sd = read_hf_config(path), load_hf_state_dict(path)
    assert config["architectures"] == ["Qwen3ForTokenClassification"]
    assert len(config["id2label"]) == 1 and config["pad_token_id"] == 0
    assert hf_sd["score.weight"].shape == (1, 64) and hf_sd["score.bias"].abs().item() > 0
    with pytest.raises(ValueError, match="task='reward' is not one of"):
        write_tiny_model(tmp_path, "llama", task="reward")
    with pytest.raises(ValueError, match="is written for .* not 'qwen3_moe'"):
        write_tiny_model(tmp_path, "qwen3_moe", task="sequence_classification")


def test_hf_head_config_names_the_classifier_and_one_label():
    base = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8, "num_labels": 2,
            "tie_word_embeddings": False}  # fmt: skip
    value = heads.hf_head_config(base, "value")
    assert value["architectures"] == ["Qwen3ForTokenClassification"]
    assert value["id2label"] == {"0": "LABEL_0"} and "num_labels" not in value
    assert value["hidden_size"] == 8 and base["architectures"] == ["Qwen3ForCausalLM"]
    from_rm = heads.hf_head_config({"architectures": ["LlamaForSequenceClassification"]}, "value")
    assert from_rm["architectures"] == ["LlamaForTokenClassification"]
    score = heads.hf_head_config(base, "score")
    assert score["architectures"] == ["Qwen3ForSequenceClassification"]
    with pytest.raises(ValueError, match="no architectures"):
        heads.hf_head_config({}, "value")
    with pytest.raises(ValueError, match="head='lm'"):
        heads.hf_head_config(base, "lm")
