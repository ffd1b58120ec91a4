"""Contract of `models.dims`, `models.names` and `models.shards`: Megatron <-> HF names and
layouts, TP shards, stage names.

Checks, against independent references: HF -> Megatron -> HF is byte identical for every family
(HF tensors come from transformers-written tiny checkpoints); the Megatron names are exactly the
list the lead read off a real megatron-core 0.16.1 GPTModel; the QKV interleave and the SwiGLU
`[gate; up]` stacking against formulas written here; every TP split (tp 1, 2, 4) gathers back
bit-exactly and each rank's slice matches the Megatron rule; PP/EP stage dicts reassemble the
full model. Pure torch; nothing is faked.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_async_rl.models.dims import ModelDims, expert_offset, layer_offset, padded_vocab_size
from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict, read_hf_config
from megatron_async_rl.models.hf_config import megatron_args_from_hf
from megatron_async_rl.models.names import (
    hf_names_for,
    hf_to_megatron,
    hf_to_megatron_param,
    megatron_param_to_hf,
    megatron_to_hf,
    pad_vocab,
    shard_spec,
    to_global_name,
    to_local_name,
)
from megatron_async_rl.models.shards import shard_for_rank, stage_state_dict, unshard
from megatron_async_rl.models.tiny import write_tiny_model

CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (ModelDims, HF state dict as written by transformers)."""
    out = {}
    for case, (family, overrides) in CASES.items():
        path = write_tiny_model(tmp_path_factory.mktemp(case), family, seed=1, **overrides)
        dims = ModelDims.from_megatron_args(megatron_args_from_hf(read_hf_config(path)))
        out[case] = (dims, load_hf_state_dict(path))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_hf_megatron_hf_round_trip_is_byte_identical(tiny, case):
    dims, hf_sd = tiny[case]
    back = megatron_to_hf(hf_to_megatron(hf_sd, dims), dims)
    assert back.keys() == hf_sd.keys()
    for key, tensor in hf_sd.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_megatron_names_and_shapes_match_megatron_core(tiny):
    dims, hf_sd = tiny["qwen3_moe"]
    mc = hf_to_megatron(hf_sd, dims)
    layer = {k[len("decoder.layers.0.") :]: tuple(v.shape) for k, v in mc.items() if ".0." in k}
    expected = {
        "input_layernorm.weight": (64,),
        "self_attention.linear_qkv.weight": ((4 + 2 * 2) * 16, 64),
        "self_attention.q_layernorm.weight": (16,),
        "self_attention.k_layernorm.weight": (16,),
        "self_attention.linear_proj.weight": (64, 4 * 16),
        "pre_mlp_layernorm.weight": (64,),
        "mlp.router.weight": (4, 64),
    }
    for j in range(4):
        expected[f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = (2 * 32, 64)
        expected[f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = (64, 32)
    assert layer == expected
    globals_ = {k: tuple(v.shape) for k, v in mc.items() if not k.startswith("decoder.layers")}
    assert globals_ == {
        "embedding.word_embeddings.weight": (96, 64),
        "decoder.final_layernorm.weight": (64,),
        "output_layer.weight": (96, 64),
    }
    dense = hf_to_megatron(*reversed(tiny["llama_tied"]))
    assert "output_layer.weight" not in dense
    assert dense["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 128, 64)
    assert dense["decoder.layers.1.mlp.linear_fc2.weight"].shape == (64, 128)


def _labelled_qkv(dims, with_bias_dim=True):
    """q/k/v whose rows hold their head id: q head h -> 100 + h, k_g -> 200 + g, v_g -> 300 + g."""
    d, nq, ng = dims.head_dim, dims.num_attention_heads, dims.num_query_groups
    rest = (dims.hidden_size,) if with_bias_dim else ()

    def rows(base, n):
        return (base + torch.arange(n)).repeat_interleave(d).reshape(-1, *[1] * len(rest))

    return [
        rows(b, n).expand(n * d, *rest).clone().float()
        for b, n in ((100, nq), (200, ng), (300, ng))
    ]


@pytest.mark.parametrize("with_bias_dim", [True, False])
def test_qkv_interleave_follows_megatron_formula(tiny, with_bias_dim):
    dims = tiny["qwen2"][0]
    q, k, v = _labelled_qkv(dims, with_bias_dim)
    name = "decoder.layers.0.self_attention.linear_qkv." + ("weight" if with_bias_dim else "bias")
    qkv = hf_to_megatron_param(name, [q, k, v], dims)
    per_group = dims.num_attention_heads // dims.num_query_groups
    # Megatron: for group g the block holds q heads g*per_group .. +per_group-1, then k_g, v_g.
    expected_heads = []
    for g in range(dims.num_query_groups):
        expected_heads += [100 + g * per_group + i for i in range(per_group)] + [200 + g, 300 + g]
    row_labels = qkv.reshape(-1, dims.head_dim, *qkv.shape[1:])
    row_labels = row_labels.reshape(len(expected_heads), -1)
    assert torch.equal(
        row_labels, torch.tensor(expected_heads).float()[:, None].expand_as(row_labels)
    )
    back = megatron_param_to_hf(name, qkv, dims)
    assert [n for n, _ in back] == list(hf_names_for(name, dims))
    assert all(torch.equal(t, ref) for (_, t), ref in zip(back, (q, k, v), strict=True))


def test_swiglu_fc1_is_gate_then_up(tiny):
    dims, hf_sd = tiny["llama"]
    mc = hf_to_megatron(hf_sd, dims)
    fc1 = mc["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = (
        hf_sd["model.layers.1.mlp.gate_proj.weight"],
        hf_sd["model.layers.1.mlp.up_proj.weight"],
    )
    assert torch.equal(fc1[:128], gate) and torch.equal(fc1[128:], up)


@pytest.mark.parametrize("case", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_every_shard_gathers_back_bit_exactly(tiny, case, tp_size):
    dims, hf_sd = tiny[case]
    for name, full in hf_to_megatron(hf_sd, dims).items():
        spec = shard_spec(name, dims)
        shards = [shard_for_rank(full, spec, r, tp_size) for r in range(tp_size)]
        if spec.partition_dim is not None:
            assert all(
                s.shape[spec.partition_dim] * tp_size == full.shape[spec.partition_dim]
                for s in shards
            )
        assert torch.equal(unshard(shards, spec), full), name


def test_rank_slices_follow_megatron_rules(tiny):
    dims, hf_sd = tiny["qwen3"]
    mc = hf_to_megatron(hf_sd, dims)
    p = "decoder.layers.0."
    fc1 = mc[p + "mlp.linear_fc1.weight"]
    spec = shard_spec(p + "mlp.linear_fc1.weight", dims)
    assert (spec.partition_dim, spec.stride) == (0, 2)
    r1 = shard_for_rank(fc1, spec, 1, 2)
    assert torch.equal(r1, torch.cat([fc1[64:128], fc1[192:256]]))  # [gate_1; up_1]
    qkv = mc[p + "self_attention.linear_qkv.weight"]  # ng=2, tp=2: rank r holds query group r
    q, k, v = (hf_sd[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    group1 = torch.cat([q[32:64], k[16:32], v[16:32]])
    assert torch.equal(
        shard_for_rank(qkv, shard_spec(p + "self_attention.linear_qkv.weight", dims), 1, 2),
        group1,
    )
    proj = mc[p + "self_attention.linear_proj.weight"]
    assert torch.equal(
        shard_for_rank(proj, shard_spec(p + "self_attention.linear_proj.weight", dims), 1, 2),
        proj[:, 32:],
    )
    for name in (p + "self_attention.q_layernorm.weight", "decoder.final_layernorm.weight"):
        assert shard_spec(name, dims).partition_dim is None


def test_vocab_padding(tiny):
    dims, hf_sd = tiny["llama"]
    assert padded_vocab_size(96, 128, 2) == 256 and padded_vocab_size(96, 8, 4) == 96
    padded = dataclasses.replace(dims, padded_vocab_size=256)
    mc = hf_to_megatron(hf_sd, padded)
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64) and not emb[96:].any()
    spec = shard_spec("output_layer.weight", padded)
    assert spec.is_vocab and spec.partition_dim == 0
    assert shard_for_rank(mc["output_layer.weight"], spec, 3, 4).shape == (64, 64)
    back = megatron_to_hf(mc, padded)
    assert torch.equal(back["model.embed_tokens.weight"], hf_sd["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="pad_vocab"):
        shard_for_rank(torch.zeros(90, 4), spec, 0, 4)
    with pytest.raises(ValueError, match="padded_size=8 < vocab rows 90"):
        pad_vocab(torch.zeros(90, 4), 8)


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 2, 2), (1, 2, 4), (4, 1, 1)])
def test_stage_state_dicts_reassemble_the_full_model(tiny, tp, pp, ep):
    dims, hf_sd = tiny["qwen3_moe"]
    dims = dataclasses.replace(dims, tied_embeddings=True)
    full = hf_to_megatron({k: v for k, v in hf_sd.items() if k != "lm_head.weight"}, dims)
    gathered: dict[str, list] = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                local = stage_state_dict(
                    full,
                    dims,
                    tp_rank=tp_rank,
                    tp_size=tp,
                    pp_rank=pp_rank,
                    pp_size=pp,
                    ep_rank=ep_rank,
                    ep_size=ep,
                )
                assert all(
                    not k.startswith("decoder.layers.") or int(k.split(".")[2]) < 2 // pp
                    for k in local
                )
                l0 = layer_offset(pp_rank, pp, dims.num_layers)
                e0 = expert_offset(ep_rank, ep, dims.num_experts)
                for k, t in local.items():
                    gathered.setdefault(
                        to_global_name(k, layer_offset=l0, expert_offset=e0), {}
                    )[tp_rank] = t
    if pp > 1:  # the last stage holds the tied embedding as output_layer.weight
        assert torch.equal(
            gathered.pop("output_layer.weight")[0],
            shard_for_rank(
                full["embedding.word_embeddings.weight"],
                shard_spec("output_layer.weight", dims),
                0,
                tp,
            ),
        )
    assert gathered.keys() == full.keys()
    for name, by_rank in gathered.items():
        shards = [by_rank[r] for r in range(tp)]
        assert torch.equal(unshard(shards, shard_spec(name, dims)), full[name]), name


def test_name_offsets():
    name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    glob = to_global_name(name, layer_offset=4, expert_offset=6)
    assert glob == "decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight"
    assert to_local_name(glob, layer_offset=4, expert_offset=6) == name
    assert to_global_name("output_layer.weight", layer_offset=4) == "output_layer.weight"
    spec = shard_spec(glob, dataclasses.replace(_moe_dims(), num_layers=8))
    assert (spec.layer, spec.expert, spec.is_expert) == (5, 6, True)
    with pytest.raises(ValueError, match="num_layers=3 is not divisible by pp_size=2"):
        layer_offset(0, 2, 3)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by ep_size=3"):
        expert_offset(0, 3, 8)


def _moe_dims(**kw):
    base = dict(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        head_dim=4,
        ffn_hidden_size=16,
        vocab_size=16,
        tied_embeddings=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        num_experts=8,
        moe_ffn_hidden_size=4,
    )
    return ModelDims(**{**base, **kw})


@pytest.mark.parametrize("case", ["llama", "qwen3_moe"])
def test_transformer_engine_norm_spelling(tiny, case):
    dims, hf_sd = tiny[case]
    te = dataclasses.replace(dims, te_fused_norms=True)
    mc = hf_to_megatron(hf_sd, te)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mc
    assert ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mc) == (case == "llama")
    assert ("decoder.layers.0.pre_mlp_layernorm.weight" in mc) == (case == "qwen3_moe")
    mc["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(1)
    back = megatron_to_hf(mc, dims)  # names of both spellings are accepted
    assert all(torch.equal(back[k], v) for k, v in hf_sd.items())


def test_errors(tiny):
    dims, hf_sd = tiny["llama"]
    with pytest.raises(
        ValueError, match="unknown Megatron parameter 'decoder.layers.0.mlp.router.weight'"
    ):
        shard_spec("decoder.layers.0.mlp.router.weight", dims)
    with pytest.raises(ValueError, match="linear_qkv.bias"):
        shard_spec("decoder.layers.0.self_attention.linear_qkv.bias", dims)
    with pytest.raises(ValueError, match="layer 7 outside num_layers=2"):
        shard_spec("decoder.layers.7.input_layernorm.weight", dims)
    with pytest.raises(ValueError, match="unknown Megatron parameter 'foo'"):
        shard_spec("foo", dims)
    with pytest.raises(ValueError, match="expert 9 outside num_experts=8"):
        shard_spec("decoder.layers.0.mlp.experts.local_experts.9.linear_fc2.weight", _moe_dims())
    partial = {k: v for k, v in hf_sd.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="lacks \\['model.norm.weight'\\]"):
        hf_to_megatron(partial, dims)
    with pytest.raises(ValueError, match="no Megatron counterpart: \\['model.extra'\\]"):
        hf_to_megatron({**hf_sd, "model.extra": torch.zeros(1)}, dims)
    mc = hf_to_megatron(hf_sd, dims)
    del mc["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        megatron_to_hf(mc, dims)
    with pytest.raises(ValueError, match="must be a multiple of num_query_groups=3"):
        _moe_dims(num_query_groups=3)
    with pytest.raises(ValueError, match="set together"):
        _moe_dims(moe_ffn_hidden_size=None)
    with pytest.raises(ValueError, match="padded_vocab_size=8 < vocab_size=16"):
        _moe_dims(padded_vocab_size=8)
