"""Multi-token-prediction layers to and from HF, in DeepSeek-V3's format (`models.names`).

Contract, with real megatron-core on gloo ranks (nothing faked but the export's checkpoint
manager, given a stand-in role), on a tiny DeepSeek-V3 written with one MTP layer
(`models.tiny`, `num_mtp_layers=1`: `model.layers.2.*`, an MoE layer):
- HF -> Megatron (--mtp-num-layers 1) -> HF gives back every tensor of the checkpoint byte for
  byte, the MTP layer's and its copies of the embedding and LM head included, at TP = 1,
  TP = 2 and EP = 2; the export's config.json says `num_nextn_predict_layers` 1;
- the loaded MTP layer's logits equal a reference from the HF tensors alone (1e-5, fp32):
  lm_head(shared_head.norm(transformers' DeepseekV3DecoderLayer(eh_proj(cat(enorm(embed(token
  t + 1)), hnorm(h_t)))))), with h the HF model's last hidden states after its final norm,
  which is what megatron-core 0.16.1 feeds its MTP block (with MTP the decoder's
  final_layernorm sits in the decoder block, `TransformerBlock.has_final_layernorm_in_this_
  stage`, and `GPTModel._postprocess` gets the block's output);
- weight sync leaves the MTP layer out: its plan, its rank state dict and its HF names;
- with --mtp-num-layers 2 the checkpoint's one MTP layer loads, the second starts fresh with a
  warning naming it, and export writes both (and num_nextn_predict_layers 2);
- a Llama model with --mtp-num-layers still warns that its MTP layers start fresh and exports
  none;
- at PP = 2 (the MTP layer and a copy of the embedding on the second stage) the round trip is
  byte for byte too, the copy loads equal to the embedding and stays so, and two train steps
  give one stage's `actor/mtp_loss` on both ranks and its weights within 1e-6.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from types import SimpleNamespace

import pytest
import torch

from tests.harness.mtp import embedding_copies, mtp_micro_batches, mtp_step
from tests.harness.ranks import spawn
from tests.harness.roles import one_window_roles

MTP = {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.1}


def _role(path: str, world_size: int, parallel: dict, mtp: dict):
    """The train role over the whole world, loaded from `path`, its groups, and the MTP
    warnings the role logged."""
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    role_logger = logging.getLogger("megatron_async_rl.roles.megatron_role")
    role_logger.addHandler(handler)
    try:
        roles, groups = one_window_roles("train", world_size, path, parallel,
                                         extra={"clip_grad": 0.0, **mtp})  # fmt: skip
    finally:
        role_logger.removeHandler(handler)
    return roles["train"], groups, [w for w in warnings if "MTP" in w]


def _round_trip_worker(rank, world_size, tmp_dir, path, parallel):
    role, _, warned = _role(path, world_size, parallel, MTP)
    return {"exported": role.gather_hf_state_dict(), "warned": warned}


def _mtp_logits(model, tokens):
    """MTP layer 0's logits [b, T, padded vocab] of a one-rank model, through megatron-core's
    own MTP block (fed as `GPTModel._postprocess` feeds it)."""
    captured = {}
    hook = model.decoder.register_forward_hook(
        lambda m, a, kw, out: captured.update(out=out, kw=kw), with_kwargs=True
    )
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        model(tokens, positions, attention_mask=None)
        hook.remove()
        kw = captured["kw"]
        stacked = model.mtp(
            input_ids=tokens, position_ids=positions, hidden_states=captured["out"],
            attention_mask=None, rotary_pos_emb=kw.get("rotary_pos_emb"),
            rotary_pos_cos=kw.get("rotary_pos_cos"), rotary_pos_sin=kw.get("rotary_pos_sin"),
            embedding=model.embedding,
        )  # fmt: skip
        logits, _ = model.output_layer(stacked.chunk(2, dim=0)[1])
    return logits.transpose(0, 1)


def _one_rank_worker(rank, world_size, tmp_dir, path, llama_path, tokens):
    from megatron_async_rl.models import weights
    from megatron_async_rl.models.shards import rank_state_dict
    from megatron_async_rl.weight_sync import broadcast, plan
    from megatron_async_rl.weight_sync.config import WeightSyncConfig

    role, groups, warned = _role(path, 1, {}, MTP)
    model = role.chunks[0]
    model.eval()
    logits = _mtp_logits(model, tokens)[..., : role.spec.vocab_size]
    key = broadcast._train_key(groups, role, 0, WeightSyncConfig())
    reshard = plan.build_plan(key.layout, key.dims, key.dtype, key.produce_bytes,
                              key.consume_bytes)  # fmt: skip
    local = broadcast._local_state(role, reshard, 0)
    synced_hf = [name for name, _ in reshard.hf_shapes]  # what the engines are sent
    two, _, warned_two = _role(path, 1, {}, {**MTP, "mtp_num_layers": 2})
    two_params = dict(two.chunks[0].named_parameters())
    llama, _, warned_llama = _role(llama_path, 1, {}, MTP)
    return {
        "logits": logits, "warned": warned,
        "dims_mtp": weights.model_dims(role.args, role.spec).hf_mtp_layers,
        "sync_mtp": key.dims.mtp_num_layers, "sync_params": sorted(reshard.params_of(0)),
        "sync_local": sorted(local), "sync_hf": sorted(synced_hf),
        "all_names": sorted(rank_state_dict(role.chunks, 1)),
        "two_exported": two.gather_hf_state_dict(), "warned_two": warned_two,
        "two_mtp1": {n: p.detach().clone() for n, p in two_params.items()
                     if n.startswith("mtp.layers.1.")},
        "warned_llama": warned_llama, "llama_exported": sorted(llama.gather_hf_state_dict()),
    }  # fmt: skip


def _hf_mtp_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """The reference of the module docstring, in a clean process (`models.hf_reference`)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    config, sd = model.config, load_hf_state_dict(path)
    prefix = f"model.layers.{config.num_hidden_layers}."
    mtp = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}

    def norm(name: str):
        module = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(mtp[name])
        return module

    layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers)
    own = {}
    for name in layer.state_dict():
        if name.endswith("experts.gate_up_proj"):  # transformers fuses [gate; up] per expert
            own[name] = torch.stack([torch.cat([mtp[f"mlp.experts.{j}.gate_proj.weight"],
                                                mtp[f"mlp.experts.{j}.up_proj.weight"]])
                                     for j in range(config.n_routed_experts)])  # fmt: skip
        elif name.endswith("experts.down_proj"):
            own[name] = torch.stack([mtp[f"mlp.experts.{j}.down_proj.weight"]
                                     for j in range(config.n_routed_experts)])  # fmt: skip
        else:
            own[name] = mtp[name]
    layer.load_state_dict(own)
    layer.eval()
    b, t = tokens.shape
    positions = torch.arange(t).expand(b, t)
    causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1).expand(b, 1, t, t)
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state  # after model.norm
        next_tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        emb = sd["model.embed_tokens.weight"][next_tokens]
        x = torch.cat([norm("enorm.weight")(emb), norm("hnorm.weight")(hidden)], -1)
        x = x @ mtp["eh_proj.weight"].T
        out = layer(x, attention_mask=causal, position_ids=positions,
                    position_embeddings=model.model.rotary_emb(x, positions))  # fmt: skip
        return norm("shared_head.norm.weight")(out) @ mtp["shared_head.head.weight"].T


@pytest.fixture(scope="module")
def deepseek(tiny_model):
    return str(tiny_model("deepseek_v3", num_mtp_layers=1))


@pytest.fixture(scope="module")
def one_rank(deepseek, tiny_model, tmp_path_factory):
    tokens = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    got = spawn(_one_rank_worker, 1, tmp_path_factory.mktemp("mtp_hf"), deepseek,
                str(tiny_model("llama")), tokens)[0]  # fmt: skip
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got["reference"] = pool.apply_async(_hf_mtp_logits, (deepseek, tokens)).get(300)
    return got


def _checkpoint(path: str) -> dict:
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    return load_hf_state_dict(path)


@pytest.mark.parametrize("world, parallel", [
    (1, {}), (2, {"tensor_model_parallel_size": 2}), (2, {"expert_model_parallel_size": 2}),
    (2, {"pipeline_model_parallel_size": 2}),
], ids=["tp1", "tp2", "ep2", "pp2"])  # fmt: skip
def test_hf_megatron_hf_round_trip_is_exact(world, parallel, deepseek, tmp_path):
    results = spawn(_round_trip_worker, world, tmp_path, deepseek, parallel)
    exported = results[0]["exported"]
    source = _checkpoint(deepseek)
    assert any(k.startswith("model.layers.2.") for k in source)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert results[0]["warned"] == []  # every MTP layer came from the checkpoint


def test_export_config_names_the_mtp_layers(deepseek, tmp_path):
    """The checkpoint manager's export (a stand-in train role and run config) writes
    `num_nextn_predict_layers` = the train role's MTP layers."""
    from megatron_async_rl.checkpoint.manager import CheckpointManager
    from megatron_async_rl.models import hf_checkpoint, hf_config

    manager = object.__new__(CheckpointManager)
    manager.root = tmp_path
    manager.cfg = SimpleNamespace(model=SimpleNamespace(hf_path=deepseek))
    for n in (1, 2):
        role = SimpleNamespace(gather_hf_state_dict=lambda: _checkpoint(deepseek), mtp_num_layers=n)
        manager.export_hf(n, SimpleNamespace(roles={"train": role}))
        written = json.loads((tmp_path / f"hf_step_{n:08d}" / "config.json").read_text())
        assert written["num_nextn_predict_layers"] == n
    args = hf_config.megatron_args_from_hf(hf_checkpoint.read_hf_config(deepseek))
    exported = hf_config.hf_config_from_megatron_args({**args, "mtp_num_layers": 3}, "deepseek_v3")
    assert exported["num_nextn_predict_layers"] == 3
    llama = {"model_type": "llama"}
    assert hf_config.export_base(llama, 2) == llama  # no MTP names there


def test_mtp_logits_are_the_hf_reference(one_rank):
    got, want = one_rank["logits"], one_rank["reference"]
    # the last position reads the rolled-in token 0 on both sides; compare all of them
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_weight_sync_leaves_mtp_out(one_rank):
    assert one_rank["dims_mtp"] == 1  # HF load and export map it ...
    assert one_rank["sync_mtp"] == 0  # ... weight sync does not
    assert any(n.startswith("mtp.layers.0.") for n in one_rank["all_names"])
    for names in (one_rank["sync_params"], one_rank["sync_local"]):
        assert names and not any(n.startswith("mtp.") for n in names)
    assert one_rank["sync_local"] == one_rank["sync_params"]
    assert "model.layers.1.mlp.gate.weight" in one_rank["sync_hf"]
    assert not any(n.startswith("model.layers.2.") for n in one_rank["sync_hf"])


def test_missing_mtp_layers_start_fresh_and_export(one_rank, deepseek):
    (warning,) = one_rank["warned_two"]
    assert "MTP layers 1 to 1 of the 2 (--mtp-num-layers) start freshly initialised" in warning
    assert "the checkpoint carries 1" in warning and "model.layers.2 on" in warning
    source, exported = _checkpoint(deepseek), one_rank["two_exported"]
    for name, tensor in source.items():  # layer 0 loaded
        assert torch.equal(exported[name], tensor), name
    fresh = {k[len("model.layers.3.") :] for k in exported.keys() - source.keys()}
    assert fresh == {k[len("model.layers.2.") :] for k in source if k.startswith("model.layers.2.")}
    assert torch.equal(exported["model.layers.3.shared_head.head.weight"], source["lm_head.weight"])
    assert torch.equal(exported["model.layers.3.eh_proj.weight"],
                       one_rank["two_mtp1"]["mtp.layers.1.eh_proj.weight"])  # fmt: skip


def test_llama_mtp_layers_have_no_hf_names(one_rank):
    (warning,) = one_rank["warned_llama"]
    assert "MTP layers 0 to 0 of the 1 (--mtp-num-layers) start freshly initialised" in warning
    assert "no MTP names" in warning
    assert "model.layers.1.mlp.down_proj.weight" in one_rank["llama_exported"]
    assert not any(n.startswith("model.layers.2.") for n in one_rank["llama_exported"])


def _train_worker(rank, world_size, tmp_dir, path, parallel):
    """Two train steps from the HF checkpoint: each step's metrics, then the HF export and
    every stage's word embedding (the MTP stage's copy included, `harness.mtp.embedding_copies`)
    after them, and after loading."""
    role, _, _ = _role(path, world_size, parallel, {**MTP, "lr": 1e-3})
    loaded = embedding_copies(role)
    micro = mtp_micro_batches()
    steps = [
        mtp_step(role, micro)[0],
        mtp_step(role, [{**mb, "tokens": mb["tokens"].roll(1, dims=1)} for mb in micro])[0],
    ]
    return {"steps": steps, "weights": role.gather_hf_state_dict(), "loaded": loaded,
            "embeddings": embedding_copies(role)}  # fmt: skip


def test_pipeline_stages_train_as_one_stage(deepseek, tmp_path):
    """pp = 2 (the MTP layer and a copy of the embedding on the second stage) from the HF
    checkpoint: the copy loads equal to the first stage's embedding, two steps give one
    stage's `actor/mtp_loss` on both ranks and its weights (1e-6), and the copy stays equal."""
    (tmp_path / "pp1").mkdir()
    (tmp_path / "pp2").mkdir()
    one = spawn(_train_worker, 1, tmp_path / "pp1", deepseek, {})[0]
    two = spawn(_train_worker, 2, tmp_path / "pp2", deepseek,
                {"pipeline_model_parallel_size": 2})  # fmt: skip
    for got in two:
        for key in ("loaded", "embeddings"):
            assert len(got[key]) == 2 and torch.equal(got[key][0], got[key][1]), key
        for step, want in zip(got["steps"], one["steps"], strict=True):
            assert step["actor/mtp_loss"] == pytest.approx(want["actor/mtp_loss"], abs=1e-6)
    assert two[1]["weights"] is None
    weights = two[0]["weights"]
    assert sorted(weights) == sorted(one["weights"])
    for key, tensor in one["weights"].items():
        diff = (weights[key] - tensor).abs().max().item()
        assert diff <= 1e-6, f"{key}: max abs diff {diff} vs one stage"
