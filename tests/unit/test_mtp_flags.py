"""--mtp-num-layers and --mtp-loss-scaling-factor: applied, and where they are refused.

Contract: both flags parse to their dests, are classified applied and reach megatron-core's
TransformerConfig kwargs; --mtp-standalone is ignored with its reason. Pipeline stages are
accepted; every layout MTP is not built for (context parallelism, a scalar-head role, a layout
that leaves MTP layers off its last stage) and every bad value is a ConfigError naming the flag,
its value and the rule; a layout with the MTP layers on its last stage and virtual stages are
accepted, and a logp role's layout drops its `m`s; the logp and ref roles
accept the flag with a warning (they leave the MTP layers out), also through a recipe, the
factor alone is ignored with a warning, and a scalar head still refuses MTP when built. The MTP
targets are the tokens k + 2 ahead, counted on real tokens only, and the name map's rank state
dict leaves MTP tensors out but the layers HF loading and export name (DeepSeek-V3's only: other
families' MTP names are errors there, and tiny models of them have none); an MTP layer's
transformer layer, `transformer_layer` in megatron-core 0.16 and `mtp_model_layer` in 0.19, has
the same HF names under both, and the rank state dict spells it as both releases checkpoint it
(`transformer_layer`). Pure: no process group; the module with `mtp.*` children is a plain
torch stand-in.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError, warn_once
from megatron_async_rl.config.megatron import core_kwargs, rules
from megatron_async_rl.config.megatron import inventory as ml
from megatron_async_rl.config.megatron import parse as mp
from megatron_async_rl.config.megatron import table as mf

FLAGS = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


def _args(**extra):
    base = dict(mf.defaults(), num_layers=2, hidden_size=64, num_attention_heads=4, lr=1e-5)
    return {**base, **mp.parse_megatron_flags(FLAGS), **extra}


def test_flags_are_applied_and_reach_the_config():
    assert mp.parse_megatron_flags(FLAGS) == {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}
    applied = frozenset(mf.flag_table()[0])
    for dest in ("mtp_num_layers", "mtp_loss_scaling_factor"):
        assert ml.classify(dest, applied) == ml.Verdict("applied"), dest
    kwargs = core_kwargs.transformer_config_kwargs(_args())
    assert (kwargs["mtp_num_layers"], kwargs["mtp_loss_scaling_factor"]) == (2, 0.3)
    rules.check_args(_args(), "train")


def test_mtp_standalone_is_ignored_with_its_reason():
    verdict = ml.classify("mtp_standalone", frozenset(mf.flag_table()[0]))
    assert verdict.kind == "ignored"
    assert "derives it from --pipeline-model-parallel-layout" in verdict.reason
    assert "mtp_standalone" not in mp.parse_megatron_flags(["--mtp-standalone"])


_VIRTUAL = [{"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
             "num_layers": 4, "position_embedding_type": "rope"},
            {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
             "position_embedding_type": "rope"}]  # fmt: skip
_LAYOUT = {"pipeline_model_parallel_size": 2, "num_layers": 4, "position_embedding_type": "rope"}


@pytest.mark.parametrize("extra", [*_VIRTUAL, {**_LAYOUT, "pipeline_model_parallel_layout":
                                               "Et|tttmmL"}])  # fmt: skip
def test_pipeline_placement_with_virtual_stages_or_a_layout_is_accepted(extra):
    rules.check_args(_args(**extra), "train")


@pytest.mark.parametrize("layout, match", [
    ("Et|tttL", r"--pipeline-model-parallel-layout = 'Et\|tttL': must place all 2 MTP layers "
     r"\('m'\) in its last stage with --mtp-num-layers = 2.*hint: e\.g\. 'Et\*3\|t\*4mL'"),
    ("Ettt|tmm|L", r"'Ettt\|tmm\|L': must place all 2 MTP layers \('m'\) in its last stage"),
    ("Et|tttmL", r"'Et\|tttmL': Number of mtp layers in layout must match mtp_num_layers"),
])  # fmt: skip
def test_a_layout_must_put_the_mtp_layers_on_its_last_stage(layout, match):
    pp = layout.count("|") + 1
    extra = {**_LAYOUT, "pipeline_model_parallel_size": pp,
             "pipeline_model_parallel_layout": layout}  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        rules.check_args(_args(**extra), "train")


def test_a_layout_without_mtp_layers_for_the_logp_role():
    assert rules.layout_without_mtp("Et|tttmmL") == "Et|tttL"
    assert rules.layout_without_mtp("E(tt|)*2m*2L") == "Ett|tt|L"
    assert rules.layout_without_mtp(None) is None


@pytest.mark.parametrize(
    "extra, role, match",
    [
        ({"pipeline_model_parallel_size": 2, "position_embedding_type": "learned_absolute"},
         "train", r"--position-embedding-type = 'learned_absolute': is not supported with "
         r"--mtp-num-layers = 2 \(multi-token prediction\) and --pipeline-model-parallel-size"),
        ({"context_parallel_size": 2}, "train", r"--context-parallel-size = 2: must be 1 with "
         r"--mtp-num-layers = 2"),
        ({"mtp_num_layers": 0}, "train", r"--mtp-num-layers = 0: must be >= 1"),
        ({"mtp_loss_scaling_factor": -0.1}, "train",
         r"--mtp-loss-scaling-factor = -0.1: must be >= 0"),
        ({}, "critic", r"--mtp-num-layers = 2: multi-token prediction needs the LM output "
         r"layer; the critic role's scalar head replaces it.*hint: set it in roles.train"),
    ],
)  # fmt: skip
def test_layouts_without_mtp_are_refused(extra, role, match):
    with pytest.raises(ConfigError, match=match):
        rules.check_args(_args(**extra), role)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_stages_are_accepted(pp):
    args = _args(pipeline_model_parallel_size=pp, num_layers=4, position_embedding_type="rope")
    rules.check_args(args, "train")


@pytest.mark.parametrize("role", ["logp", "ref"])
def test_forward_only_roles_ignore_mtp_with_a_warning(role, caplog):
    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    rules.check_args(_args(pipeline_model_parallel_size=2), role)
    assert f"--mtp-num-layers 2 is ignored for the {role} role" in caplog.text


def test_the_factor_alone_is_ignored_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    args = {**_args(), "mtp_num_layers": None, "mtp_loss_scaling_factor": 0.5}
    rules.check_args(args, "train")
    assert "--mtp-loss-scaling-factor 0.5 is ignored without --mtp-num-layers" in caplog.text


def test_a_scalar_head_still_refuses_mtp():
    from megatron_async_rl.models import heads

    config = SimpleNamespace(mtp_num_layers=1)
    with pytest.raises(ValueError, match=r"--mtp-num-layers=1: multi-token prediction needs"):
        heads.attach_scalar_head(None, config, "value", tp_group=None, seed=0)


def test_layer_targets_are_real_tokens_k_plus_2_ahead():
    from megatron_async_rl.algorithms.mtp import layer_targets

    tokens = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])
    padding = tokens == 0
    targets, counted = layer_targets(tokens, padding, 0)
    assert targets.tolist() == [[12, 13, 14, 15, 0, 0], [22, 23, 0, 0, 0, 0]]
    assert counted.tolist() == [[True] * 4 + [False] * 2, [True] * 2 + [False] * 4]
    targets, counted = layer_targets(tokens, padding, 1)
    assert targets[0].tolist() == [13, 14, 15, 0, 0, 0]
    assert counted.sum(1).tolist() == [3, 1]
    assert not layer_targets(tokens, padding, 4)[1].any()  # nothing 6 ahead


def test_rank_state_dict_leaves_mtp_tensors_out():
    from megatron_async_rl.models.shards import rank_state_dict

    model = torch.nn.Module()
    model.decoder = torch.nn.Linear(2, 2, bias=False)
    model.mtp = torch.nn.ModuleDict({"eh_proj": torch.nn.Linear(4, 2, bias=False)})
    assert list(rank_state_dict(model)) == ["decoder.weight"]
    assert list(rank_state_dict([model, model])) == [
        "model0.decoder.weight", "model1.decoder.weight"
    ]  # fmt: skip
    # the MTP layers below `mtp_num_layers` (those with HF names) for HF load and export
    model.mtp = torch.nn.Module()
    model.mtp.layers = torch.nn.ModuleList([torch.nn.Linear(4, 2, bias=False)] * 2)
    assert list(rank_state_dict(model, 1)) == ["decoder.weight", "mtp.layers.0.weight"]
    assert list(rank_state_dict(model, 0)) == ["decoder.weight"]
    # megatron-core 0.19's module name of an MTP layer's transformer layer
    model.mtp.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.mtp.layers[0].mtp_model_layer = torch.nn.Linear(2, 2, bias=False)
    assert list(rank_state_dict(model, 1)) == [
        "decoder.weight", "mtp.layers.0.transformer_layer.weight"
    ]  # fmt: skip


def test_mtp_layers_have_hf_names_in_deepseek_v3_format_only(tmp_path):
    import dataclasses

    from megatron_async_rl.models.dims import MLADims, ModelDims
    from megatron_async_rl.models.names import (
        hf_names_for,
        shard_spec,
        stage_param_names,
        to_global_name,
    )
    from megatron_async_rl.models.tiny import write_tiny_model

    dims = ModelDims(
        num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=2, head_dim=4,
        ffn_hidden_size=16, vocab_size=32, tied_embeddings=False, add_qkv_bias=False,
        qk_layernorm=False, mtp_num_layers=1,
    )  # fmt: skip
    assert dims.hf_mtp_layers == 0
    assert not any(n.startswith("mtp.") for n in stage_param_names(dims))
    with pytest.raises(ValueError, match=r"MTP layer 0 has no HF name \(hf_mtp_layers=0"):
        shard_spec("mtp.layers.0.eh_proj.weight", dims)
    mla = dataclasses.replace(dims, mla=MLADims(None, 4, 4, 2, 4))
    assert hf_names_for("mtp.layers.0.final_layernorm.weight", mla) == (
        "model.layers.2.shared_head.norm.weight",)  # fmt: skip
    assert shard_spec("mtp.layers.0.eh_proj.weight", mla).partition_dim == 0
    for suffix, hf in [("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
                       ("mlp.linear_fc1.weight", "mlp.gate_proj.weight")]:  # fmt: skip
        for inner in ("transformer_layer", "mtp_model_layer"):  # megatron-core 0.16, 0.19
            name = f"mtp.layers.0.{inner}.{suffix}"
            assert hf_names_for(name, mla)[0] == f"model.layers.2.{hf}", name
            assert to_global_name(name, layer_offset=1) == (
                f"mtp.layers.0.transformer_layer.{suffix}")  # fmt: skip
    with pytest.raises(ValueError, match="unknown Megatron parameter 'mtp.layers.0.bogus'"):
        shard_spec("mtp.layers.0.bogus", mla)
    with pytest.raises(ValueError, match="mtp_num_layers=-1 must be >= 0"):
        dataclasses.replace(dims, mtp_num_layers=-1)
    with pytest.raises(ValueError, match="num_mtp_layers=1: only deepseek_v3 names MTP layers"):
        write_tiny_model(tmp_path, "llama", num_mtp_layers=1)


def test_a_recipe_builds_mtp_for_the_train_role_only(caplog):
    from megatron_async_rl.recipe.load import build_config

    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    tree = {
        "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
        "megatron": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                     "vocab_size": 128, "lr": 1e-5},
    }  # fmt: skip
    cfg = build_config(tree, FLAGS)
    assert cfg.role_megatron_args["train"]["mtp_num_layers"] == 2
    assert "--mtp-num-layers 2 is ignored for the logp role" in caplog.text
    assert "--mtp-num-layers 2 is ignored for the ref role" in caplog.text
