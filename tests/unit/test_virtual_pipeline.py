"""Virtual (interleaved) pipeline stages: the flags' rules, each chunk's layers, the plan.

Contracts, with no process group (the numerics are `tests/distributed/test_virtual_pipeline.py`):
- --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank resolve to
  megatron-core's virtual_pipeline_model_parallel_size as Megatron-LM derives it (with its p2p
  overlap default), and every rule Megatron-LM or megatron-core enforces is a ConfigError
  naming the flag, the value and the rule;
- each model chunk's layers (`ModelDims.stage_layers` with a vp stage) are those megatron-core's
  `get_transformer_layer_offset` / `get_num_layers_to_build` give it, even and uneven stages;
- the reshard plan of a V = 2 train role covers every HF tensor once, as V = 1 does, from
  parameters named as `shards.stage_entries` names each rank's chunks;
- the interleaved schedule's micro-batch rules, checked by the dry run and before each pass
  (`minibatch`, `preflight.check_batches`).
The reassembly of every tensor through a V = 2 plan is `tests/unit/test_reshard_plan.py`'s.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_async_rl.algorithms import minibatch
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron import core_kwargs
from megatron_async_rl.config.megatron import table as mf
from megatron_async_rl.distributed.layout import RoleGrid
from megatron_async_rl.models.dims import ModelDims
from megatron_async_rl.models.names import rank_global_name, split_chunk_name, stage_param_names
from megatron_async_rl.models.shards import stage_entries
from megatron_async_rl.weight_sync.plan import build_plan


def _config(*flags: str, num_layers: int = 8):
    from megatron_async_rl.recipe.load import build_config

    tree = {
        "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
        "megatron": {"num_layers": num_layers, "hidden_size": 64, "num_attention_heads": 4,
                     "vocab_size": 128, "lr": 1e-5},
    }  # fmt: skip
    return build_config(tree, list(flags)).role_megatron_args["train"]


PP2 = ("--pipeline-model-parallel-size", "2")


@pytest.mark.parametrize(
    "flags, vp",
    [((*PP2, "--num-virtual-stages-per-pipeline-rank", "2"), 2),
     ((*PP2, "--num-layers-per-virtual-pipeline-stage", "1"), 4),  # 8 / (2 x 1)
     ((*PP2, "--num-layers-per-virtual-pipeline-stage", "4"), 1),  # one chunk: no interleaving
     (("--num-virtual-stages-per-pipeline-rank", "1"), 1),
     ((), 1)],
)  # fmt: skip
def test_flags_resolve_to_megatron_cores_virtual_size(flags, vp):
    from megatron.core.transformer import TransformerConfig

    args = _config(*flags)
    kwargs = core_kwargs.transformer_config_kwargs(args)
    assert core_kwargs.virtual_stages(args) == vp
    assert kwargs["virtual_pipeline_model_parallel_size"] == (vp if vp > 1 else None)
    # Megatron-LM: p2p overlap on (its default) with virtual stages, then no batched p2p ops
    assert (kwargs["overlap_p2p_comm"], kwargs["batch_p2p_comm"]) == (
        (True, False) if vp > 1 else (False, True))  # fmt: skip
    config = TransformerConfig(**{**kwargs, **dict.fromkeys(mf.MEGATRON_LM_DEFAULTS, False),
                                  "overlap_p2p_comm": kwargs["overlap_p2p_comm"]})  # fmt: skip
    assert config.virtual_pipeline_model_parallel_size == kwargs[
        "virtual_pipeline_model_parallel_size"]  # fmt: skip
    assert ModelDims.from_megatron_args({**args, "ffn_hidden_size": 128}).vp_size == vp


STAGES, LAYERS = "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"


@pytest.mark.parametrize(
    "flags, match",
    [((*PP2, STAGES, "2", LAYERS, "2"),
      rf"{LAYERS} = 2: cannot be combined with {STAGES} = 2"),
     ((STAGES, "2"), rf"{STAGES} = 2: needs --pipeline-model-parallel-size > 1"),
     ((LAYERS, "2"), rf"{LAYERS} = 2: needs --pipeline-model-parallel-size > 1"),
     ((*PP2, LAYERS, "3"), rf"{LAYERS} = 3: must divide the layers of each pipeline rank"),
     ((*PP2, STAGES, "3"), rf"{STAGES} = 3: each pipeline rank holds 8 / 2 of --num-layers = 8: "
                           "must split into 3 model chunks"),
     ((*PP2, STAGES, "2", "--pipeline-model-parallel-layout", "Ett|ttttttL"),
      rf"{STAGES} = 2: cannot be combined with --pipeline-model-parallel-layout"),
     ((*PP2, LAYERS, "1", "--decoder-first-pipeline-num-layers", "2"),
      rf"{LAYERS} = 1: cannot be combined with --decoder-first/last-pipeline-num-layers"),
     ((*PP2, STAGES, "2", "--decoder-first-pipeline-num-layers", "3"),
      "--decoder-first-pipeline-num-layers = 3: must be divisible by the 2 virtual pipeline"),
     ((*PP2, STAGES, "2", "--no-overlap-p2p-communication"),
      "--no-overlap-p2p-communication = True: with 2 virtual pipeline stages per rank needs "
      "--pipeline-model-parallel-size > 2"),
     (("--pipeline-model-parallel-size", "4", STAGES, "2",
       "--microbatch-group-size-per-virtual-pipeline-stage", "2"),
      "--microbatch-group-size-per-virtual-pipeline-stage = 2: must be >= "
      "--pipeline-model-parallel-size = 4"),
     ((*PP2, "--virtual-pipeline-model-parallel-size", "2"),
      "--virtual-pipeline-model-parallel-size = 2: is derived here"),
     ((*PP2, STAGES, "0"), rf"{STAGES} = 0: must be >= 1")],
)  # fmt: skip
def test_virtual_pipeline_rules_are_named(flags, match):
    with pytest.raises(ConfigError, match=match):
        _config(*flags)


def test_no_overlap_is_fine_past_two_pipeline_ranks():
    args = _config("--pipeline-model-parallel-size", "4", STAGES, "2",
                   "--no-overlap-p2p-communication")  # fmt: skip
    kwargs = core_kwargs.transformer_config_kwargs(args)
    assert (kwargs["overlap_p2p_comm"], kwargs["batch_p2p_comm"]) == (False, True)


@pytest.mark.parametrize(
    "num_layers, pp, vp, first, last",
    [(8, 2, 2, None, None), (8, 4, 2, None, None), (12, 2, 3, None, None), (8, 2, 4, None, None),
     (10, 3, 2, 2, 4), (14, 4, 2, 2, None), (8, 2, 2, None, 2)],
)  # fmt: skip
def test_each_chunk_holds_megatron_cores_layers(num_layers, pp, vp, first, last):
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )  # fmt: skip
    dims = ModelDims(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=4,
        head_dim=16, ffn_hidden_size=96, vocab_size=100, tied_embeddings=False,
        add_qkv_bias=False, qk_layernorm=False, first_stage_layers=first,
        last_stage_layers=last, vp_size=vp,
    )  # fmt: skip
    seen = []
    for p in range(pp):
        for v in range(vp):
            ours = dims.stage_layers(p, pp, v)
            assert ours.start == get_transformer_layer_offset(config, vp_stage=v, pp_rank=p)
            assert len(ours) == get_num_layers_to_build(config, vp_stage=v, pp_rank=p)
            seen += list(ours)
    assert sorted(seen) == list(range(num_layers))
    with pytest.raises(ValueError, match="needs the model chunk"):
        dims.stage_layers(0, pp)


_DIMS = ModelDims(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
    ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128, tied_embeddings=True,
    add_qkv_bias=False, qk_layernorm=False,
)  # fmt: skip


def test_stage_names_of_each_chunk():
    dims = dataclasses.replace(_DIMS, vp_size=2)
    rank0 = [e.local for e in stage_entries(dims, pp_rank=0, pp_size=2)]
    rank1 = [e.local for e in stage_entries(dims, pp_rank=1, pp_size=2)]
    assert rank0[0] == "model0.embedding.word_embeddings.weight"
    assert "model1.decoder.layers.0.mlp.linear_fc1.weight" in rank0  # layer 2
    assert not any("final_layernorm" in n or "output_layer" in n for n in rank0)
    assert rank1[-2:] == ["model1.decoder.final_layernorm.weight", "model1.output_layer.weight"]
    assert rank_global_name(
        "model1.decoder.layers.0.mlp.linear_fc1.weight", dims, pp_rank=1, pp_size=2
    ) == "decoder.layers.3.mlp.linear_fc1.weight"  # fmt: skip
    names = stage_param_names(dims, pp_rank=0, pp_size=2) + stage_param_names(
        dims, pp_rank=1, pp_size=2)  # fmt: skip
    assert sorted(names) == sorted(
        stage_param_names(_DIMS, pp_rank=0, pp_size=2)
        + stage_param_names(_DIMS, pp_rank=1, pp_size=2)
    )  # the same parameters, in other places
    with pytest.raises(ValueError, match="is not the name of one of 2 model chunks"):
        split_chunk_name("decoder.final_layernorm.weight", 2)


def test_plan_with_two_chunks_covers_the_model_as_one_chunk_does():
    layout = RoleGrid(0, tp=2, pp=2, dp=1)
    v1 = build_plan(layout, _DIMS, "float32", 24_000, 9_000)
    v2 = build_plan(layout, dataclasses.replace(_DIMS, vp_size=2), "float32", 24_000, 9_000)
    assert v2.hf_shapes == v1.hf_shapes

    def sent(plan):
        return sorted((p.hf_name, p.start, p.stop) for s in plan.senders for b in s.buckets
                      for m in b.messages for p in m.pieces)  # fmt: skip

    assert sent(v2) == sent(v1) and [s.rank for s in v2.senders] == [0, 2]
    dims = v2.dims
    for rank, (tp, pp) in {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}.items():
        held = {e.local for e in stage_entries(dims, tp_rank=tp, tp_size=2, pp_rank=pp,
                                                   pp_size=2)}  # fmt: skip
        assert v2.params_of(rank) <= held and v2.params_of(rank)


@pytest.mark.parametrize(
    "num_micro, group, ok",
    [(4, None, True), (2, None, True), (1, None, False), (3, None, False), (6, None, True),
     (5, 3, True), (4, 3, False), (2, 3, False)],
)  # fmt: skip
def test_interleaved_schedule_micro_batch_rules(num_micro, group, ok):
    def check():
        minibatch.check_virtual_pipeline_microbatches(num_micro, 2, 2, 2, group, "role logp")

    if ok:
        check()
    else:
        with pytest.raises(ConfigError, match=r"--micro-batch-size = 2: role logp: a pass of "
                           rf"{2 * num_micro} samples in {num_micro} micro-batches"):  # fmt: skip
            check()


def test_role_passes_are_checked_before_the_run():
    args = {"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
            "num_layers": 8, "micro_batch_size": 4}  # fmt: skip
    minibatch.check_role_microbatches("logp", args, 16, 1)  # 4 micro-batches
    minibatch.check_role_microbatches("train", args, 16, 2)  # 16 / (4 x 2) = 2
    with pytest.raises(ConfigError, match="role logp's forward: a pass of 16 samples in 1 "):
        minibatch.check_role_microbatches("logp", {**args, "micro_batch_size": None}, 16, 1)
    with pytest.raises(
        ConfigError,
        match=r"role train's optimizer step \(--global-batch-size "
        "8 over 2 data-parallel ranks\\): a pass of 4 samples in 1 micro",
    ):
        minibatch.check_role_microbatches("train", {**args, "global_batch_size": 8}, 16, 2)
    with pytest.raises(ConfigError, match="role critic's forward"):
        minibatch.check_role_microbatches("critic", {**args, "micro_batch_size": 16}, 16, 1)
    minibatch.check_role_microbatches(
        "logp",
        {**args, "num_virtual_stages_per_pipeline_rank": None, "micro_batch_size": None},
        16,
        1,
    )  # V = 1


def test_dry_run_checks_each_roles_passes():
    """`preflight.check_batches` (the dry run) on resolved Megatron args of train and logp at
    pp = 2, V = 2; the rest of the config and the layout stood in by the fields it reads."""
    from types import SimpleNamespace

    from megatron_async_rl.jobs import preflight

    def check(*flags):
        args = _config(*PP2, STAGES, "2", *flags)
        cfg = SimpleNamespace(
            trainer=SimpleNamespace(job="grpo"), role_megatron_args={"train": args, "logp": args},
            rollout=SimpleNamespace(num_prompts_per_step=2),
            algorithm=SimpleNamespace(num_samples_per_prompt=4, ppo_epochs=1),
        )  # fmt: skip
        layout = SimpleNamespace(parallelism={"train": None, "logp": None}, dp_of=lambda r: 1)
        preflight.check_batches(cfg, layout)

    check("--micro-batch-size", "2")  # 8 samples: 4 micro-batches in every pass
    with pytest.raises(ConfigError, match="--micro-batch-size = 8: role train's optimizer step"):
        check("--micro-batch-size", "8")
    with pytest.raises(ConfigError, match="--micro-batch-size = 2: role train's optimizer step "
                       r"\(--global-batch-size 2 over 1"):  # fmt: skip
        check("--micro-batch-size", "2", "--global-batch-size", "2")
