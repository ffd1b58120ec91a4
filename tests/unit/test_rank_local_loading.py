"""Each rank reads only its shards of a HF checkpoint (review finding 10).

Contracts checked: `HFTensorReader` reads a tensor's bytes (or a row/column range of them) only
when asked (its counter) and enforces an index file as `load_hf_state_dict` did;
`shards.stage_state_dict_from_hf` gives exactly what the whole-model path gives
(`stage_state_dict(hf_to_megatron(all))`) for every (tp, pp, ep) stage of a dense and a MoE
family, with whole tensors sliced after reading or with only the rank's slices read, while
reading only the HF tensors of that stage: for PP=2 the first stage reads the embedding and its
layers, not the others; for EP=2 each rank reads its half of the experts; with TP=2 a rank
reads under 60% of its stage's bytes (norms and the router are replicated), also with a padded,
tied vocabulary; `check_hf_names` keeps the whole-model checks (a missing source, a tensor
without a counterpart) on names alone. Pure torch and safetensors;
tiny checkpoints written here.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_async_rl.models.dims import ModelDims
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
    stage_param_names,
)
from megatron_async_rl.models.shards import stage_state_dict, stage_state_dict_from_hf
from megatron_async_rl.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family in ("llama", "qwen3_moe"):
        path = write_tiny_model(tmp_path_factory.mktemp(family), family, seed=2)
        dims = ModelDims.from_megatron_args(megatron_args_from_hf(read_hf_config(path)))
        out[family] = (path, dims, load_hf_state_dict(path))
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


STAGES = [dict(tp_rank=1, tp_size=2), dict(pp_rank=0, pp_size=2), dict(pp_rank=1, pp_size=2),
          dict(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2)]  # fmt: skip


CASES = [(f, r) for f in ("llama", "qwen3_moe") for r in STAGES] + [
    ("qwen3_moe", dict(ep_rank=1, ep_size=2))  # experts: the MoE family only
]


@pytest.mark.parametrize(("family", "ranks"), CASES, ids=str)
def test_a_stage_read_alone_equals_the_whole_model_path_and_reads_only_its_sources(
    models, family, ranks
):
    path, dims, hf_sd = models[family]
    want = stage_state_dict(hf_to_megatron(hf_sd, dims), dims, **ranks)
    stage = {k: v for k, v in ranks.items() if k.startswith(("pp", "ep"))}
    sources = {h for n in stage_param_names(dims, **stage) for h in hf_names_for(
        "embedding.word_embeddings.weight" if n == "output_layer.weight" and dims.tied_embeddings
        else n, dims)}  # fmt: skip
    whole, mine = _nbytes(hf_sd.values()), _nbytes(hf_sd[h] for h in sources)
    for sliced in (False, True):  # whole tensors then sliced, or only the rank's slices read
        reader = HFTensorReader(path)
        got = stage_state_dict_from_hf(
            reader.read, dims, reader.read_range if sliced else None, **ranks
        )
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (sliced, name)
        if sliced and ranks.get("tp_size", 1) > 1:  # the split tensors: about half of each
            assert reader.bytes_read < 0.6 * mine, (reader.bytes_read, mine)
        else:
            assert reader.bytes_read == mine
        if stage or (sliced and "tp_size" in ranks):
            assert reader.bytes_read < whole
        print(f"{family} {ranks} sliced={sliced}: read {reader.bytes_read} of {whole} bytes")


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tp_slices_of_a_padded_tied_vocabulary(tmp_path, tp_rank):
    path = write_tiny_model(tmp_path, "qwen3", seed=5, tie_word_embeddings=True)
    dims = ModelDims.from_megatron_args(megatron_args_from_hf(read_hf_config(path)))
    dims = dataclasses.replace(dims, padded_vocab_size=dims.vocab_size + 6)  # rows to pad
    ranks = dict(tp_rank=tp_rank, tp_size=2, pp_rank=1, pp_size=2)  # tied output on stage 1
    want = stage_state_dict(hf_to_megatron(load_hf_state_dict(path), dims), dims, **ranks)
    reader = HFTensorReader(path)
    got = stage_state_dict_from_hf(reader.read, dims, reader.read_range, **ranks)
    assert "output_layer.weight" in got and got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_the_first_of_two_stages_reads_its_layers_and_not_the_others(models):
    path, dims, _ = models["llama"]
    reader, read = HFTensorReader(path), []
    stage_state_dict_from_hf(lambda n: read.append(n) or reader.read(n), dims, pp_rank=0,
                                pp_size=2)  # fmt: skip
    layers = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
    assert "model.embed_tokens.weight" in read and "model.norm.weight" not in read
    assert layers == set(range(dims.num_layers // 2))


def test_names_alone_keep_the_whole_model_checks(models):
    _, dims, hf_sd = models["llama"]
    check_hf_names(hf_sd.keys(), dims)
    with pytest.raises(ValueError, match="lacks \\['model.norm.weight'\\]"):
        check_hf_names([k for k in hf_sd if k != "model.norm.weight"], dims)
    with pytest.raises(ValueError, match="no Megatron counterpart: \\['model.extra'\\]"):
        check_hf_names([*hf_sd, "model.extra"], dims)


def test_the_reader_enforces_the_index_and_reads_on_request(tmp_path):
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, str(tmp_path / "one.safetensors"))
    save_file({"c": torch.ones(3, dtype=torch.float64)}, str(tmp_path / "two.safetensors"))
    index = {"weight_map": {"a": "one.safetensors", "b": "one.safetensors",
                            "c": "two.safetensors"}}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reader = HFTensorReader(tmp_path)
    assert sorted(reader.keys()) == ["a", "b", "c"] and reader.bytes_read == 0
    assert torch.equal(reader.read("c"), torch.ones(3, dtype=torch.float64))
    assert reader.bytes_read == 24
    with pytest.raises(KeyError, match="has no tensor 'd'"):
        reader.read("d")
    index["weight_map"]["d"] = "two.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists tensors not found in its files: \\['d'\\]"):
        HFTensorReader(tmp_path)
    index["weight_map"]["d"] = "three.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names files that do not exist"):
        HFTensorReader(tmp_path)
