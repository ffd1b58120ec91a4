"""Every flag of Megatron-LM (`arguments.py` at each supported tag) has a verdict here, and
applied flags reach megatron-core's config objects.

Contract: (1) each dest of the flag inventory of the installed megatron-core's release series
(`inventory.RELEASES`; the verdict depends on that release's config dataclasses, so the other
inventories are checked where their release is installed: scripts/test.sh runs both ends) is
applied, aliased, ignored with a reason or refused with a reason and a hint; none is unknown; the
coverage of the model, parallelism, training, learning-rate, optimizer and precision groups is
printed per inventory (`-s`) and bounded below.
(2) For each applied flag that is a field of TransformerConfig, MLATransformerConfig,
OptimizerConfig or DistributedDataParallelConfig, a non-default value given on the command line
reaches that class's constructor kwargs (the effect on what is built). (3) Ignored flags are
listed in one warning line; refused and unknown flags of one command line are reported together.
Nothing is faked; megatron-core's dataclasses are the reference.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from importlib.metadata import version

import pytest

from megatron_async_rl.config.errors import ConfigError, ConfigErrors, warn_once
from megatron_async_rl.config.megatron import core_kwargs
from megatron_async_rl.config.megatron import inventory as ml
from megatron_async_rl.config.megatron import parse as mp
from megatron_async_rl.config.megatron import table as mf
from megatron_async_rl.config.megatron import verdicts as mv

CORE_GROUPS = {
    "model": ("transformer configuration", "network size", "moe", "mla",
              "experimental_attention_variant", "heterogeneous architecture"),
    "parallelism": ("distributed", "distributed init"),  # renamed in core_v0.17
    "training": ("training",),
    "learning rate": ("learning rate and weight decay",),
    "optimizer": ("regularization",),
    "precision": ("mixed precision", "Transformer-Engine"),
}  # fmt: skip


INSTALLED = ml.release_tag()
TAGS = pytest.mark.parametrize("tag", [
    pytest.param(tag, marks=pytest.mark.skipif(
        tag != INSTALLED, reason=f"the verdicts need megatron-core of {tag} ({INSTALLED} here)"
    )) for tag in ml.RELEASES.values()
])  # fmt: skip
MIN_COVERAGE = {"core_v0.16.1": 0.78, "core_v0.17.1": 0.75, "core_v0.18.2": 0.73,
                "core_v0.19.0": 0.70}  # fmt: skip
"""The share of the core groups applied or aliased, per inventory (measured with each release's
megatron-core: 81.0%, 76.7%, 74.8%, 71.6%): later releases add flags of structures not built
here (muP, fused or grouped weight layouts, DSA, hybrid models; the printed lists)."""


def _verdicts(tag: str | None = None):
    applied = frozenset(mf.flag_table()[0])
    return {dest: (row, ml.classify(dest, applied, tag)) for dest, row in ml.lm_dests(tag).items()}


@TAGS
def test_every_megatron_lm_flag_has_a_verdict(tag):
    verdicts = _verdicts(tag)
    assert len(verdicts) > 600  # the whole inventory, not a sample
    unknown = sorted(d for d, (_, v) in verdicts.items() if v.kind == "unknown")
    assert not unknown, f"flags of Megatron-LM without a verdict: {unknown}"
    for dest, (_, verdict) in verdicts.items():
        if verdict.kind in ("ignored", "refused", "aliased"):
            assert verdict.reason, dest
        if verdict.kind == "refused":
            assert verdict.hint, dest


@TAGS
def test_coverage_of_the_core_groups(tag, capsys):
    verdicts = _verdicts(tag)
    counts = collections.Counter()
    total = collections.Counter()
    lines = []
    for name, groups in CORE_GROUPS.items():
        rows = [(d, v) for d, (row, v) in verdicts.items() if row.group in groups]
        used = [d for d, v in rows if v.kind in ("applied", "aliased")]
        counts[name], total[name] = len(used), len(rows)
        rest = sorted(f"{d} ({v.kind})" for d, v in rows if v.kind not in ("applied", "aliased"))
        lines.append(f"{name}: {len(used)}/{len(rows)} applied or aliased; not: {', '.join(rest)}")
    share = sum(counts.values()) / sum(total.values())
    knobs = sum(total.values()) - sum(
        1 for d, (row, _) in verdicts.items()
        if d in mv.NOT_KNOBS_IN_MEGATRON_LM and any(row.group in g for g in CORE_GROUPS.values())
    )  # fmt: skip
    with capsys.disabled():
        print(f"\nMegatron-LM {tag}, megatron-core {version('megatron-core')} installed:\n"
              + "\n".join(lines) + f"\nall core groups: {sum(counts.values())}/"
              f"{sum(total.values())} = {share:.1%} applied or aliased; of the flags that "
              f"configure a GPT run in Megatron-LM itself: {sum(counts.values())}/{knobs} = "
              f"{sum(counts.values()) / knobs:.1%}")  # fmt: skip
    assert share >= MIN_COVERAGE[tag]


@pytest.mark.parametrize("release, tag", [
    ("0.16.1", "core_v0.16.1"), ("0.16.3", "core_v0.16.1"), ("0.17.0", "core_v0.17.1"),
    ("0.18.1", "core_v0.18.2"), ("0.19.2", "core_v0.19.0"), ("0.19.5rc1", "core_v0.19.0"),
])  # fmt: skip
def test_the_installed_release_picks_its_inventory(release, tag):
    assert ml.release_tag(release) == tag


@pytest.mark.parametrize("release", ["0.16.0", "0.15.3", "0.20.0", "0.20.0rc0", "1.0", "dev"])
def test_a_release_without_an_inventory_is_an_error(release):
    with pytest.raises(ConfigError, match=rf"installed megatron-core = '{release}': has no "
                       r"Megatron-LM flag inventory here: supported releases are >=0.16.1,<0.20 "
                       r"\(0.16.x: core_v0.16.1, .*0.19.x: core_v0.19.0\); hint: pip install "
                       r"'megatron-core>=0.16.1,<0.20'"):  # fmt: skip
        ml.release_tag(release)


def test_each_inventory_names_its_tag_and_commit():
    """The files are the script's output for the tags of `RELEASES` (commits of Megatron-LM's
    repository), and every dest the tables name exists in at least one of them."""
    commits = {"core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
               "core_v0.17.1": "266f1c97dca477ca8b92c16087506da2000b0b84",
               "core_v0.18.2": "571370c829ca768fe37244f4e2e7f28d8accc4ab",
               "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3"}  # fmt: skip
    assert sorted(p.stem for p in ml.INVENTORY_DIR.glob("*.json")) == sorted(commits)
    every = set()
    for tag, commit in commits.items():
        head = json.loads((ml.INVENTORY_DIR / f"{tag}.json").read_text())
        assert (head["tag"], head["commit"]) == (tag, commit)
        assert ml.inventory(tag)[0] == commit
        every |= set(ml.lm_dests(tag))
    tables = (mv.ALIASES, mv.IGNORED, mv.REFUSED, mv.RECIPE_ALIASES, mv.REFUSED_VALUES,
              mv.REFUSED_CHOICES, mv.ONLY_WITH, mv.INERT_HERE)  # fmt: skip
    assert not sorted(d for table in tables for d in table if d not in every)
    assert {d for group in mf.APPLIED_HERE.values() for d in group} <= every


def test_batch_ramp_and_group_flags_are_applied():
    """Their effects: tests/unit/test_batch_ramp.py (the G of each RL step, the lr schedule) and
    tests/unit/test_pg_options.py (each role group's NCCL options and SHARP)."""
    applied = frozenset(mf.flag_table()[0])
    for dest in ("rampup_batch_size", "decrease_batch_size_if_needed",
                 "nccl_communicator_config_path", "high_priority_stream_groups", "use_sharp",
                 "sharp_enabled_group"):  # fmt: skip
        assert ml.classify(dest, applied) == ml.Verdict("applied"), dest
    args = mp.parse_megatron_flags(["--rampup-batch-size", "16", "16", "128", "--use-sharp",
                                    "--high-priority-stream-groups", "dp_cp", "tp"])  # fmt: skip
    assert args == {"rampup_batch_size": [16, 16, 128], "use_sharp": True,
                    "high_priority_stream_groups": ["dp_cp", "tp"]}  # fmt: skip


def _other_value(spec: mf.ArgSpec):
    if spec.type == "bool":
        return not spec.default
    if spec.choices:
        others = [c for c in spec.choices if c != spec.default]
        return others[0] if others else None
    if spec.type == "int":
        return (spec.default or 0) + 3
    if spec.type == "float":
        return (spec.default or 0.0) + 0.25
    if spec.type == "str":
        return None  # free-form strings (paths, names): no safe generic value
    return None


# Fields whose kwargs are derived from other flags, as Megatron-LM derives them.
_DERIVED = {
    "num_query_groups": "applied only with --group-query-attention",
    "virtual_pipeline_model_parallel_size": "from the virtual pipeline flags "
    "(test_virtual_pipeline.py)",
    "overlap_p2p_comm": "off without virtual pipeline stages, as in Megatron-LM",
    "params_dtype": "from --bf16/--fp16",
    "pipeline_dtype": "from --bf16/--fp16",
    "layernorm_epsilon": "from --norm-epsilon",
    "moe_layer_freq": "a list expression (test_list_and_enum_flags)",
    "attention_backend": "an enum (test_list_and_enum_flags)",
}


def _config_fields():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    def names(cls):
        return {f.name for f in dataclasses.fields(cls)}

    return {
        core_kwargs.transformer_config_kwargs: names(TransformerConfig),
        core_kwargs.optimizer_config_kwargs: names(OptimizerConfig),
        core_kwargs.ddp_config_kwargs: names(DistributedDataParallelConfig),
        "mla": names(MLATransformerConfig),
    }


def test_applied_dataclass_flags_reach_their_config():
    specs = mf.flag_table()[0]
    fields = _config_fields()
    checked = 0
    for dest, spec in sorted(specs.items()):
        value = _other_value(spec)
        if value is None or dest in _DERIVED or ml.classify(dest, specs).kind != "applied":
            continue
        if ml.refused_value(dest, value):
            continue  # one refused value of an applied dest: test_values_not_built_are_refused
        for build, names in fields.items():
            if dest not in names:
                continue
            if build == "mla":
                mla = {"multi_latent_attention": True, dest: value}
                kwargs = core_kwargs.transformer_config_kwargs(mla)
            else:
                kwargs = build({dest: value})
            assert kwargs.get(dest) == value, (dest, value, build)
            checked += 1
    assert checked > 250


def test_values_not_built_are_refused():
    """Config fields whose meaning Megatron-LM's own loop builds: the asking value is refused
    with its reason (all of one command line together), the default passes, and the knobs of a
    refused structure are ignored in the one warning line, naming that structure's flag."""
    with pytest.raises(ConfigErrors) as info:
        mp.parse_megatron_flags([
            "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2",
            "--tp-comm-overlap", "--experimental-attention-variant", "gated_delta_net",
            "--pipeline-model-parallel-comm-backend", "ucc",
        ])  # fmt: skip
    errors = {e.key: str(e) for e in info.value.errors}
    assert list(errors) == [
        "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "--tp-comm-overlap",
        "--experimental-attention-variant", "--pipeline-model-parallel-comm-backend",
    ]  # fmt: skip
    assert "reads the global tensor-parallel group" in errors["--use-megatron-fsdp"]
    assert "hint: use --use-torch-fsdp2" in errors["--use-megatron-fsdp"]
    assert "inter-instance group" in errors["--num-distributed-optimizer-instances"]
    assert "userbuffers" in errors["--tp-comm-overlap"]
    args = mp.parse_megatron_flags([
        "--num-distributed-optimizer-instances", "1", "--pipeline-model-parallel-comm-backend",
        "nccl",
    ])  # fmt: skip
    assert args == {"num_distributed_optimizer_instances": 1,
                    "pipeline_model_parallel_comm_backend": "nccl"}  # fmt: skip
    with pytest.raises(ConfigError, match="recipe megatron.use_megatron_fsdp = True: Megatron"):
        mp.normalize_megatron_section({"use_megatron_fsdp": True}, "recipe megatron")


ON_0_19 = pytest.mark.skipif(INSTALLED != "core_v0.19.0", reason=f"{INSTALLED} is installed")


@ON_0_19
def test_flags_new_in_0_19_that_are_not_built_are_refused():
    with pytest.raises(ConfigErrors) as info:
        mp.parse_megatron_flags([
            "--use-mup", "--mla-down-proj-fusion", "--moe-single-grouped-weight",
            "--tensor-parallel-num-weight-shards", "4", "--mtp-detach-heads",
            "--moe-router-load-balancing-type", "quantile_balancing", "--hybrid-layer-pattern",
            "M*M*", "--step-batch-size-schedule", "0:16", "--moe-paged-stash",
            "--moe-mlp-glu-interleave-size", "32", "--mup-output-mult", "0.5",
        ])  # fmt: skip
    errors = {e.key: str(e) for e in info.value.errors}
    assert list(errors) == [
        "--use-mup", "--mla-down-proj-fusion", "--moe-single-grouped-weight",
        "--tensor-parallel-num-weight-shards", "--mtp-detach-heads",
        "--moe-router-load-balancing-type", "--hybrid-layer-pattern",
        "--step-batch-size-schedule", "--moe-paged-stash", "--moe-mlp-glu-interleave-size",
        "--mup-output-mult",
    ]  # fmt: skip
    assert "the HF model the SGLang engines run has none of these multipliers" in errors[
        "--use-mup"]  # fmt: skip
    assert "qb_beta" in errors["--moe-router-load-balancing-type"]
    assert "hint: use --rampup-batch-size" in errors["--step-batch-size-schedule"]
    args = mp.parse_megatron_flags([
        "--moe-router-load-balancing-type", "aux_loss", "--mup-output-mult", "1.0",
    ])  # fmt: skip
    assert args == {"moe_router_load_balancing_type": "aux_loss", "mup_output_mult": 1.0}
    applied = frozenset(mf.flag_table()[0])
    assert ml.classify("moe_router_load_balancing_type", applied) == ml.Verdict("applied")


@ON_0_19
def test_flags_new_in_0_19_that_apply_reach_their_config(caplog):
    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    args = mp.parse_megatron_flags([
        "--moe-flex-dispatcher-num-sms", "24", "--mlp-chunks-for-training", "2",
        "--flash-attention-version", "3", "--fp4-param-gather", "--muon-nesterov",
        "--lion-beta1", "0.9", "--disable-gloo-process-groups",
        "--mup-base-hidden-size", "256", "--dsa-kernel-backend", "tilelang", "--yarn-beta-fast",
        "32", "--cuda-graph-modules", "attn", "--flight-recorder-dump-path", "/tmp/fr",
        "--inference-moe-token-dispatcher-type", "nccl", "--optimizer-cuda-graph",
    ])  # fmt: skip
    kwargs = core_kwargs.transformer_config_kwargs(args)
    assert (kwargs["moe_flex_dispatcher_num_sms"], kwargs["mlp_chunks_for_training"]) == (24, 2)
    assert kwargs["flash_attention_version"] == 3 and kwargs["fp4_param"] is True
    assert kwargs["cuda_graph_modules"] == [] and "cuda_graph_scope" not in kwargs
    assert core_kwargs.ddp_config_kwargs(args)["fp4_param_gather"] is True
    opt = core_kwargs.optimizer_config_kwargs(args)
    assert opt["muon_nesterov"] is True and opt["lion_beta1"] == 0.9
    [line] = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert "--mup-base-hidden-size: read only with --use-mup, refused here" in line
    for flag in ("--dsa-kernel-backend", "--yarn-beta-fast", "--cuda-graph-modules",
                 "--flight-recorder-dump-path", "--inference-moe-token-dispatcher-type",
                 "--optimizer-cuda-graph"):  # fmt: skip
        assert flag in line


def test_knobs_of_refused_structures_are_ignored(caplog):
    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    args = mp.parse_megatron_flags([
        "--no-tp-comm-bulk-wgrad", "--fsdp-double-buffer", "--mamba-state-dim", "64",
        "--mtp-standalone", "--lr", "1e-6",
        "--cuda-graph-impl=local", "--cuda-graph-warmup-steps", "2",
    ])  # fmt: skip
    assert dict(args) == {"lr": 1e-6}
    [line] = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    for flag, parent in (("--no-tp-comm-bulk-wgrad", "--tp-comm-overlap"),
                         ("--fsdp-double-buffer", "--use-megatron-fsdp"),
                         ("--mamba-state-dim", "--hybrid-override-pattern")):  # fmt: skip
        assert flag in line and f"read only with {parent}, refused here" in line
    assert "--mtp-standalone: megatron-core 0.16.1 derives it from" in line
    assert "--cuda-graph-impl, --cuda-graph-warmup-steps: CUDA graphs" in line


def test_the_te_rng_tracker_needs_te():
    from megatron_async_rl.distributed.layout import Parallelism
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.models import builder

    cpu = detect_platform("cpu", "gloo")
    base = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="--te-rng-tracker: Transformer Engine's RNG tracker"):
        builder.build_transformer_config({**base, "use_te_rng_tracker": True},
                                         Parallelism(1, 1), cpu)  # fmt: skip


def test_list_and_enum_flags():
    from megatron.core.transformer.enums import AttnBackend

    args = mp.parse_megatron_flags([
        "--moe-layer-freq", "([0]+[1]*3)", "--recompute-modules", "mlp", "moe",
        "--attention-backend", "local", "--window-size", "(128, 0)", "--squared-relu",
        "--init-method-xavier-uniform", "--use-rope-scaling", "--rope-scaling-factor", "4",
        "--fp8-param-gather", "--empty-unused-memory-level", "1",
    ])  # fmt: skip
    kwargs = core_kwargs.transformer_config_kwargs(args)
    assert kwargs["moe_layer_freq"] == [0, 1, 1, 1]
    assert kwargs["recompute_modules"] == ["mlp", "moe"]
    assert kwargs["attention_backend"] is AttnBackend.local
    assert kwargs["window_size"] == (128, 0)
    assert kwargs["activation_func"].__name__ == "squared_relu"
    assert kwargs["init_method"].__name__ == "xavier_uniform_"
    assert kwargs["fp8_param"] is True
    gpt = core_kwargs.gpt_model_kwargs(args)
    assert gpt["rope_scaling"] is True and gpt["rope_scaling_factor"] == 4.0
    assert args["empty_unused_memory_level"] == 1


def test_aliases_translate_as_megatron_lm_does():
    args = mp.parse_megatron_flags([
        "--recompute-activations", "--no-bias-swiglu-fusion", "--no-persist-layer-norm",
        "--use-flash-attn", "--use-rotary-position-embeddings", "--norm-epsilon", "1e-6",
        "--decoder-first-pipeline-num-layers", "3", "--ddp-bucket-size", "1000",
        "--grad-reduce-in-bf16", "--no-check-for-nan-in-loss-and-grad", "--te-rng-tracker",
    ])  # fmt: skip
    assert args["recompute_granularity"] == "selective"
    assert args["bias_activation_fusion"] is False and args["persist_layer_norm"] is False
    assert args["attention_backend"] == "flash" and args["position_embedding_type"] == "rope"
    assert args["norm_epsilon"] == 1e-6 and args["num_layers_in_first_pipeline_stage"] == 3
    assert args["bucket_size"] == 1000 and args["grad_reduce_in_fp32"] is False
    assert args["check_for_nan_in_grad"] is False and args["use_te_rng_tracker"] is True


def test_recipe_aliases_of_megatron_lm_rl_flags():
    args = mp.parse_megatron_flags(["--grpo-group-size", "4", "--rl-default-temperature", "0.7"])
    assert args.recipe_sets == {
        "algorithm.num_samples_per_prompt": ("4", "--grpo-group-size"),
        "rollout.temperature": ("0.7", "--rl-default-temperature"),
    }
    with pytest.raises(ConfigError, match="grpo_group_size = 4: is a recipe key here; hint: set "
                       "algorithm.num_samples_per_prompt instead"):  # fmt: skip
        mp.normalize_megatron_section({"grpo_group_size": 4}, "megatron")


def test_ignored_flags_in_one_warning_line(caplog):
    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    args = mp.parse_megatron_flags([
        "--data-path", "/data/a", "--split", "99,1,0", "--tokenizer-type", "HF",
        "--log-interval", "1", "--use-mcore-models", "--lr", "1e-6",
    ])  # fmt: skip
    assert dict(args) == {"lr": 1e-6}
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1
    for flag in ("--data-path", "--split", "--tokenizer-type", "--log-interval"):
        assert flag in lines[0]
    assert "pretraining data" in lines[0] and "tokenizer" in lines[0]


def test_every_error_of_a_command_line_together():
    with pytest.raises(ConfigErrors) as info:
        mp.parse_megatron_flags([
            "--lr", "fast", "--batch-size", "4", "--use-legacy-models",
            "--hiden-size", "64", "--seq-length", "128", "--yaml-cfg", "run.yaml",
        ])  # fmt: skip
    keys = [e.key for e in info.value.errors]
    assert keys == [
        "--lr", "--batch-size", "--use-legacy-models", "--hiden-size",
        "--yaml-cfg",
    ]  # fmt: skip
    text = str(info.value)
    assert "use --micro-batch-size" in text and "did you mean --hidden-size?" in text
    assert "5 errors, one per line" in text and text.count("\n") == 4


def test_refused_flag_names_reason_and_fix():
    with pytest.raises(ConfigError, match=r"--spec = \['a', 'b'\]: custom layer specs are not "
                       r"loaded here; hint: drop the flag"):  # fmt: skip
        mp.parse_megatron_flags(["--spec", "a", "b"])


def test_flag_arity_follows_megatron_lm():
    args = mp.parse_megatron_flags(["--moe-aux-loss-coeff", "0.01", "--lr=2e-6", "--seed", "7"])
    assert args == {"moe_aux_loss_coeff": 0.01, "lr": 2e-6, "seed": 7}
    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff = '0.1 0.2': takes one value"):
        mp.parse_megatron_flags(["--moe-aux-loss-coeff", "0.1", "0.2"])


# --- flags applied to our loop and recipe (one owner per knob) ---------------------------------
def _tree(**extra):
    tree = {
        "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
        "megatron": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                     "vocab_size": 128, "lr": 1e-5},
    }  # fmt: skip
    tree.update(extra)
    return tree


def test_train_iters_and_samples_set_the_rl_steps():
    from megatron_async_rl.recipe.load import build_config

    tree = _tree(rollout={"num_prompts_per_step": 4}, algorithm={"num_samples_per_prompt": 4})
    # 16 samples per RL step, 4 per optimizer step: 4 optimizer steps per RL step
    cfg = build_config(tree, ["--global-batch-size", "4", "--train-iters", "20"])
    assert cfg.trainer.num_steps == 5
    cfg = build_config(tree, ["--global-batch-size", "4", "--train-samples", "64"])
    assert cfg.trainer.num_steps == 4
    # a flag after -- overrides the recipe's key (the highest precedence) ...
    cfg = build_config(
        {**tree, "trainer": {"num_steps": 3}}, ["--global-batch-size", "4", "--train-iters", "20"]
    )
    assert cfg.trainer.num_steps == 5
    # ... two spellings in the same recipe must agree
    same_file = {**tree, "trainer": {"num_steps": 3}}
    same_file["megatron"] = {**tree["megatron"], "global_batch_size": 4, "train_iters": 20}
    with pytest.raises(ConfigError, match=r"trainer.num_steps = 3: disagrees with --train-iters "
                       r"= 20: 5 RL steps of 4 optimizer step\(s\) each"):  # fmt: skip
        build_config(same_file, [])


def test_seed_and_micro_batch_have_one_owner():
    """Flags after -- override the recipe's key; two spellings in one recipe must agree."""
    from megatron_async_rl.recipe.load import build_config

    cfg = build_config(_tree(data=None), ["--seed", "7", "--micro-batch-size", "2"])
    assert cfg.seed == 7 and cfg.trainer.micro_batch_size == 2
    assert cfg.role_megatron_args["train"]["seed"] == 7
    cfg = build_config(_tree(seed=3, trainer={"micro_batch_size": 4}),
                       ["--seed", "7", "--micro-batch-size", "2"])  # fmt: skip
    assert cfg.seed == 7 and cfg.trainer.micro_batch_size == 2  # flags after --: precedence
    same_file = _tree(seed=3, trainer={"micro_batch_size": 4})
    same_file["megatron"].update(seed=7, micro_batch_size=2)
    with pytest.raises(ConfigErrors, match=r"seed = 3: disagrees with megatron.seed = 7"):
        build_config(same_file, [])  # two spellings of a knob in one recipe
    cfg = build_config(_tree(seed=5), [])  # the recipe's seed alone: fine
    assert cfg.seed == 5


def test_megatron_lm_rl_flags_set_recipe_keys():
    from megatron_async_rl.recipe.load import build_config

    cfg = build_config(_tree(), ["--grpo-group-size", "4", "--rl-default-temperature", "0.7"])
    assert cfg.algorithm.num_samples_per_prompt == 4 and cfg.rollout.temperature == 0.7
    cfg = build_config(_tree(algorithm={"num_samples_per_prompt": 8}), ["--grpo-group-size", "4"])
    assert cfg.algorithm.num_samples_per_prompt == 4  # the flag after -- wins
    cfg = build_config(_tree(algorithm={"loss_agg_mode": "seq-mean-token-mean"}),
                       ["--calculate-per-token-loss"])  # fmt: skip
    assert cfg.algorithm.loss_agg_mode == "token-mean"  # Megatron-LM's per-token loss
    assert not cfg.role_megatron_args["train"].get("calculate_per_token_loss")


def test_exit_duration_stops_at_a_boundary(tmp_path):
    import torch.distributed as dist

    from megatron_async_rl.checkpoint.manager import SignalFlag

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert not SignalFlag([], exit_after_s=3600.0).any_rank(None)
        assert SignalFlag([], exit_after_s=0.0).any_rank(None)
    finally:
        dist.destroy_process_group()


def test_manual_gc_and_empty_cache(monkeypatch):
    import torch

    from megatron_async_rl.roles import learn

    calls = []
    monkeypatch.setattr(learn.gc, "collect", lambda: calls.append("gc"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cache"))
    args = {"manual_gc": True, "manual_gc_interval": 2, "empty_unused_memory_level": 1}
    for step in (1, 2, 3, 4):
        learn.memory_hygiene(args, step, after="train")
    learn.memory_hygiene(args, 4, after="logp")  # level 1: not after forwards
    assert calls == ["cache", "gc", "cache", "cache", "gc", "cache"]
    learn.memory_hygiene({"empty_unused_memory_level": 2}, 1, after="ref")
    assert calls[-1] == "cache" and len(calls) == 7


def test_exit_interval_counts_optimizer_steps():
    from types import SimpleNamespace

    from megatron_async_rl.checkpoint.manager import CheckpointManager

    def reached(interval, gbs, versions):
        cfg = SimpleNamespace(
            role_megatron_args={"train": {"exit_interval": interval, "global_batch_size": gbs}},
            rollout=SimpleNamespace(num_prompts_per_step=4),
            algorithm=SimpleNamespace(num_samples_per_prompt=4, ppo_epochs=1),
        )
        manager = SimpleNamespace(cfg=cfg)
        manager._crossed = lambda dest, v: CheckpointManager._crossed(manager, dest, v)
        return [v for v in versions if CheckpointManager.exit_interval_reached(manager, v)]

    assert reached(3, None, range(1, 10)) == [3, 6, 9]  # one optimizer step per RL step
    assert reached(6, 4, range(1, 7)) == [2, 3, 5, 6]  # 4 per RL step: 8 >= 6, 12, 20 >= 18, 24
    assert reached(None, None, range(1, 5)) == []


def test_exit_signal_handler_joins_save_on_signal():
    from megatron_async_rl.recipe.load import build_config

    cfg = build_config(_tree(), ["--exit-signal-handler", "--exit-signal", "SIGUSR1"])
    assert "SIGUSR1" in cfg.checkpoint.save_on_signal
    with pytest.raises(ConfigError, match="--exit-signal = 'SIGINT': must be one of SIGTERM, "
                       "SIGUSR1"):  # fmt: skip
        build_config(_tree(), ["--exit-signal-handler", "--exit-signal", "SIGINT"])
    with pytest.raises(ConfigError, match=r"checkpoint.save_on_signal = \['SIGTERM'\]: does not "
                       "catch --exit-signal SIGUSR1"):  # fmt: skip
        build_config(_tree(checkpoint={"save_on_signal": ["SIGTERM"]}),
                     ["--exit-signal-handler", "--exit-signal", "SIGUSR1"])  # fmt: skip


def test_distributed_backend_owns_platform_backend():
    from megatron_async_rl.recipe.load import build_config

    with pytest.raises(ConfigError, match="nccl needs device cuda"):
        build_config(_tree(platform={"device": "cpu"}), ["--distributed-backend", "nccl"])
    cfg = build_config(_tree(platform={"device": "cpu"}), ["--distributed-backend", "gloo"])
    assert cfg.platform.backend == "gloo"


def test_replica_weight_hash_check(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron_async_rl.roles import learn

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        role = SimpleNamespace(
            args={"check_weight_hash_across_dp_replicas_interval": 2},
            chunks=[torch.nn.Linear(3, 2)], pgc=SimpleNamespace(dp=None),
        )  # fmt: skip
        learn.check_replicas_agree(role, 2)  # one replica: agrees with itself
        gathered = []

        def two_replicas(out, obj, group=None):
            gathered.append(obj)
            out[:] = [obj, "another"]

        monkeypatch.setattr(learn.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(learn.devices, "all_gather_object", two_replicas)
        learn.check_replicas_agree(role, 3)  # not a multiple of the interval: no check
        assert gathered == []
        with pytest.raises(RuntimeError, match="data-parallel replicas' weights differ"):
            learn.check_replicas_agree(role, 4)
    finally:
        dist.destroy_process_group()


def test_gloo_groups_flag_matches_the_only_mode():
    assert dict(mp.parse_megatron_flags(["--disable-gloo-process-groups"])) == {}
    [dest] = {ml.inventory()[1]["--disable-gloo-process-groups"].dest}  # renamed in core_v0.17
    with pytest.raises(ConfigError, match=f"{dest} = True: the distributed "
                       "optimizer here uses the role's own groups"):  # fmt: skip
        mp.normalize_megatron_section({dest: True}, "megatron")


def test_checkpoint_flags():
    from types import SimpleNamespace

    from megatron_async_rl.checkpoint.manager import CheckpointManager
    from megatron_async_rl.recipe.load import build_config

    tree = _tree(rollout={"num_prompts_per_step": 4}, algorithm={"num_samples_per_prompt": 4})
    flags = ["--save-interval", "6", "--global-batch-size", "4", "--async-save",
             "--ckpt-format", "torch_dist", "--finetune"]  # fmt: skip
    cfg = build_config(tree, flags)
    assert cfg.checkpoint.async_save is True
    manager = SimpleNamespace(cfg=cfg, config=cfg.checkpoint)
    manager._crossed = lambda dest, v: CheckpointManager._crossed(manager, dest, v)
    # 4 optimizer steps per RL step: 8 >= 6 at v2, 12 at v3, 20 >= 18 at v5, 24 at v6
    assert [v for v in range(1, 7) if CheckpointManager.due(manager, v)] == [2, 3, 5, 6]
    with pytest.raises(ConfigError, match="--ckpt-format = 'torch': checkpoints here are "
                       "megatron-core dist_checkpointing in torch_dist format"):  # fmt: skip
        build_config(tree, ["--ckpt-format", "torch"])
    with pytest.raises(ConfigError, match="checkpoint.every_steps = 5: and --save-interval = 6 "
                       "both set the checkpoint cadence"):  # fmt: skip
        build_config({**tree, "checkpoint": {"every_steps": 5}}, ["--save-interval", "6"])


def test_iterations_to_skip(tmp_path):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron_async_rl.algorithms.config import GRPOConfig
    from megatron_async_rl.roles import learn

    assert mp.parse_megatron_flags(["--iterations-to-skip", "5", "6"]) == {
        "iterations_to_skip": [5, 6]
    }
    calls = []
    role = SimpleNamespace(
        args={"global_batch_size": 2, "micro_batch_size": 2, "iterations_to_skip": [5, 6]},
        pgc=SimpleNamespace(dp=None), mask_moe_padding=False,
        train_step=lambda micro, loss_fn: calls.append(len(micro)) or {"actor/grad_norm": 1.0},
    )  # fmt: skip
    work = SimpleNamespace(
        step=1, batch={"tokens": torch.zeros(8, 4), "behaviour_logp": torch.zeros(8, 3)},
        loss_mask_BT=torch.ones(8, 3), adv_B=torch.zeros(8), logp_BT=torch.zeros(8, 3),
        ref_logp_BT=torch.zeros(8, 3),
    )  # fmt: skip
    cfg = SimpleNamespace(algorithm=GRPOConfig(shuffle_minibatches=False), seed=0,
                          trainer=SimpleNamespace(micro_batch_size=2),
                          moe=SimpleNamespace(routing_replay="off"))  # fmt: skip
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        metrics = learn.train_on_batch(role, work, cfg)  # iterations 4..7 of step 1
        assert metrics["actor/optimizer_steps"] == 2 and calls == [1, 1]
        work.step = 0  # iterations 0..3: none skipped
        assert learn.train_on_batch(role, work, cfg)["actor/optimizer_steps"] == 4
    finally:
        dist.destroy_process_group()


def test_trainer_micro_batch_size_is_the_shared_megatron_value():
    from megatron_async_rl.recipe.load import build_config

    tree = _tree(trainer={"micro_batch_size": 4})
    tree["roles"]["logp"] = {"megatron": {"micro_batch_size": 2}}
    cfg = build_config(tree, [])
    assert cfg.role_megatron_args["train"]["micro_batch_size"] == 4
    assert cfg.role_megatron_args["logp"]["micro_batch_size"] == 2  # a role's own value wins


def test_seed_seeds_python_numpy_and_torch():
    import random

    import numpy as np
    import torch

    from megatron_async_rl.models import builder

    draws = []
    for _ in range(2):
        builder.seed_generators(7, pp_rank=1)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
    assert draws[0] == draws[1]
    random.seed(107)  # seed + 100 x pipeline rank, as Megatron-LM
    np.random.seed(107)
    torch.manual_seed(7)
    assert draws[0] == (random.random(), float(np.random.rand()), float(torch.rand(())))


@pytest.mark.parametrize(
    "env, reports",
    [
        ({}, True),  # a dry run or a single process
        ({"RANK": "0"}, True),  # plain torchrun: rank 0 says it
        ({"RANK": "1"}, False),
        ({"RANK": "0", "MEGATRON_ASYNC_RL_VALIDATED": "1"}, False),  # the launcher's check did
    ],
)
def test_config_notes_are_printed_once_per_run(env, reports, monkeypatch, caplog):
    for name in ("RANK", "MEGATRON_ASYNC_RL_VALIDATED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert mp.reports_config_notes() is reports
    # The rules' notes on a role's flags follow it (every rank resolves the config again)
    from megatron_async_rl.config.megatron.rules import check_args

    warn_once.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_args({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "lr": 1e-5,
                    "mtp_num_layers": 1}, role="logp")  # fmt: skip
    records = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == int(reports)
    assert all("--mtp-num-layers 1 is ignored for the logp role" in r for r in records)


def test_timeouts_at_init_and_after():
    from megatron_async_rl.recipe.load import build_config

    cfg = build_config(_tree(), ["--distributed-timeout-minutes", "10",
                                 "--distributed-timeout-seconds-after-init", "120"])  # fmt: skip
    assert cfg.collective_timeout_s() == (120.0, "--distributed-timeout-seconds-after-init")
    assert cfg.startup_timeout_s() == 600.0 + cfg.engine.startup_timeout_s
    cfg = build_config(_tree(), ["--distributed-timeout-minutes", "10"])
    assert cfg.collective_timeout_s() == (600.0, "--distributed-timeout-minutes")
    assert cfg.startup_timeout_s() == 600.0 + cfg.engine.startup_timeout_s
    with pytest.raises(ConfigError, match=r"platform.timeout_s = 30.0: disagrees with "
                       r"--distributed-timeout-seconds-after-init \(120 s\)"):  # fmt: skip
        build_config(_tree(platform={"timeout_s": 30.0}),
                     ["--distributed-timeout-seconds-after-init", "120"])  # fmt: skip


@pytest.mark.parametrize(
    "num_layers, pp, first, last",
    [(8, 4, 1, 3), (8, 4, None, 2), (9, 4, 3, None), (6, 2, 2, 4), (8, 4, None, None)],
)
def test_uneven_stages_split_as_megatron_core(num_layers, pp, first, last):
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_async_rl.models.dims import stage_layers

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
    )  # fmt: skip
    for rank in range(pp):
        ours = stage_layers(rank, pp, num_layers, first, last)
        assert ours.start == get_transformer_layer_offset(config, pp_rank=rank)
        assert len(ours) == get_num_layers_to_build(config, pp_rank=rank)


def test_pipeline_splits_the_weight_names_cannot_follow_are_refused():
    from megatron_async_rl.recipe.load import build_config

    with pytest.raises(ConfigError, match="--account-for-embedding-in-pipeline-split = True: is "
                       "not mapped by the HF weight names here"):  # fmt: skip
        build_config(_tree(), ["--pipeline-model-parallel-size", "2",
                               "--account-for-embedding-in-pipeline-split"])  # fmt: skip
    from megatron_async_rl.models.dims import stage_layers

    with pytest.raises(ValueError, match="does not split evenly over the 2 other pipeline"):
        stage_layers(1, 3, 5, first=2, last=None)  # 3 layers left for 2 stages


def test_structures_without_weight_names_are_refused():
    from megatron_async_rl.recipe.load import build_config

    if "--use-legacy-models" in ml.inventory()[1]:  # removed in core_v0.18
        with pytest.raises(ConfigError, match="--use-legacy-models = True: legacy"):
            mp.parse_megatron_flags(["--use-legacy-models"])
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "32"]
    build_config(_tree(), [*moe, "--moe-layer-freq", "1"])
    build_config(_tree(), [*moe, "--moe-layer-freq", "[1]*2"])
    with pytest.raises(ConfigError, match=r"--moe-layer-freq = \[0, 1, 1\]: a pattern needs one "
                       "0 \\(dense\\) or 1 \\(MoE\\) per layer: 2 of them"):  # fmt: skip
        build_config(_tree(), [*moe, "--moe-layer-freq", "[0]+[1]*2"])


def test_mla_and_mixed_moe_flags_reach_the_config_and_the_name_map():
    """The DeepSeek structures (multi-latent attention, dense first layers, shared experts,
    expert bias) are applied: they reach megatron-core's MLATransformerConfig and the name map
    (whose logits parity with transformers is tests/distributed/test_hf_parity.py's)."""
    from megatron_async_rl.models.dims import ModelDims
    from megatron_async_rl.models.names import hf_names_for, stage_param_names
    from megatron_async_rl.recipe.load import build_config

    flags = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0]+[1]",
             "--moe-shared-expert-intermediate-size", "64", "--moe-router-enable-expert-bias",
             "--moe-router-score-function", "sigmoid", "--multi-latent-attention",
             "--q-lora-rank", "24", "--kv-lora-rank", "32", "--qk-head-dim", "16",
             "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm",
             "--rotary-scaling-factor", "4", "--mscale", "0.9",
             "--mscale-all-dim", "0.8"]  # fmt: skip
    args = build_config(_tree(), flags).role_megatron_args["train"]
    kwargs = core_kwargs.transformer_config_kwargs(args)
    assert core_kwargs.transformer_config_class(args).__name__ == "MLATransformerConfig"
    assert (kwargs["q_lora_rank"], kwargs["kv_lora_rank"], kwargs["qk_pos_emb_head_dim"]) == (
        24, 32, 8)  # fmt: skip
    assert (kwargs["rotary_scaling_factor"], kwargs["mscale"], kwargs["mscale_all_dim"]) == (
        4.0, 0.9, 0.8)  # fmt: skip
    assert kwargs["moe_layer_freq"] == [0, 1]
    assert kwargs["moe_shared_expert_intermediate_size"] == 64
    dims = ModelDims.from_megatron_args(args)
    names = stage_param_names(dims)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # dense first layer
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
    assert hf_names_for("decoder.layers.1.mlp.router.expert_bias", dims) == (
        "model.layers.1.mlp.gate.e_score_correction_bias",)  # fmt: skip
    assert hf_names_for("decoder.layers.0.self_attention.linear_kv_down_proj.weight", dims) == (
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",)  # fmt: skip


def test_pipeline_layout_is_checked_and_reaches_the_name_map():
    """--pipeline-model-parallel-layout (logits parity: tests/distributed/test_hf_parity.py)."""
    from megatron_async_rl.models.dims import ModelDims
    from megatron_async_rl.recipe.load import build_config

    pp = ["--pipeline-model-parallel-size", "2"]
    args = build_config(_tree(), [*pp, "--pipeline-model-parallel-layout", "Et|tL"])
    dims = ModelDims.from_megatron_args(args.role_megatron_args["train"])
    assert [list(dims.stage_layers(r, 2)) for r in (0, 1)] == [[0], [1]]
    args = build_config(_tree(), [*pp, "--pipeline-model-parallel-layout", "E|ttL"])
    dims = ModelDims.from_megatron_args(args.role_megatron_args["train"])
    assert [list(dims.stage_layers(r, 2)) for r in (0, 1)] == [[], [0, 1]]
    for layout, rule in (
        ("Et|t|tL", "has 3 stages; one per pipeline rank \\(2\\)"),
        ("Ettt|tL", "Number of decoder layers 4must match num_layers 2"),
        ("t|tL", "The first layer must be embedding"),
    ):
        with pytest.raises(ConfigError, match=f"--pipeline-model-parallel-layout = '{layout}"
                           f"': .*{rule}"):  # fmt: skip
            build_config(_tree(), [*pp, "--pipeline-model-parallel-layout", layout])
    with pytest.raises(ConfigError, match="cannot be combined with --decoder-first"):
        build_config(_tree(), [*pp, "--pipeline-model-parallel-layout", "Et|tL",
                               "--decoder-first-pipeline-num-layers", "1"])  # fmt: skip
