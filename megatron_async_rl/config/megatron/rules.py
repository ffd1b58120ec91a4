"""Cross-field rules on one Megatron role's resolved args, as Megatron-LM and megatron-core apply
them: sizes and divisibility, MoE, the pipeline split and its layout, virtual pipeline stages,
torch FSDP2.

Owned here: `check_args` (the first broken rule of a role's args, a ConfigError naming the flag
to change) and `layout_stage_layers` (a --pipeline-model-parallel-layout's decoder layers per
stage, by megatron-core's own parser). What one flag's value may be (types, ranges) is
`config.megatron.table`; callers: `recipe.load` (every placed role), `models.dims`.
"""

from __future__ import annotations

from typing import Any

from megatron_async_rl.config.errors import ConfigError, warn_once
from megatron_async_rl.config.megatron.parse import reports_config_notes
from megatron_async_rl.config.megatron.table import with_defaults


def _note(message: str) -> None:
    """A warning about how a role's flags resolve, printed once per run: every rank resolves
    the config again after the launcher's dry run, which already said it."""
    if reports_config_notes():
        warn_once(message)


def layout_stage_layers(
    layout: str, pp: int, num_layers: int, mtp_num_layers: int | None = None
) -> tuple[int, ...]:
    """Decoder layers per pipeline stage of a --pipeline-model-parallel-layout (megatron-core's
    parser and validation; the MTP layers it places, `m`, must be the `mtp_num_layers`);
    ValueError naming the rule it breaks."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(layout)
        if stages != pp:
            raise ValueError(
                f"has {stages} stages; one per pipeline rank ({pp}) is built here (virtual "
                "stages from a layout are not: --num-virtual-stages-per-pipeline-rank builds "
                "them)"
            )
        parsed = PipelineParallelLayerLayout(layout, pp)
        places_mtp = any(LayerType.mtp in chunk for stage in parsed.layout for chunk in stage)
        parsed.validate_layer_layout(num_layers, mtp_num_layers if places_mtp else None)
    except (AssertionError, ValueError, SyntaxError, TypeError, NameError) as error:
        raise ValueError(str(error) or "is not a layout megatron-core can parse") from None
    return tuple(stage[0].count(LayerType.decoder) for stage in parsed.layout)


def _layout_rules(a: dict[str, Any], pp: int) -> tuple:
    layout = a.get("pipeline_model_parallel_layout")
    if layout is None:
        return ()
    uneven = a.get("num_layers_in_first_pipeline_stage") is not None or (
        a.get("num_layers_in_last_pipeline_stage") is not None
    )
    problem = None
    if uneven:
        problem = "cannot be combined with --decoder-first/last-pipeline-num-layers"
    else:
        try:
            layout_stage_layers(layout, pp, a["num_layers"], a.get("mtp_num_layers"))
        except ValueError as error:
            problem = str(error)
    return ((
        problem is not None, "--pipeline-model-parallel-layout", layout, problem or "",
        "e.g. 'Et*3|t*4L' for 7 layers on 2 stages: E embedding, t a decoder layer, L the loss,"
        " | between stages",
    ),)  # fmt: skip


_VP_LAYERS = "--num-layers-per-virtual-pipeline-stage"
_VP_STAGES = "--num-virtual-stages-per-pipeline-rank"
_AT_MOST_ONE = "(Megatron-LM takes at most one of them)"


def _virtual_pipeline_problem(a: dict[str, Any], pp: int) -> tuple | None:
    """(flag, value, rule, hint) of the first virtual-pipeline rule `a` breaks (Megatron-LM's
    `validate_args` and megatron-core's TransformerConfig checks), else None."""
    per_stage = a.get("num_layers_per_virtual_pipeline_stage")
    stages = a.get("num_virtual_stages_per_pipeline_rank")
    direct = a.get("virtual_pipeline_model_parallel_size")
    if direct is not None:
        return (
            "--virtual-pipeline-model-parallel-size", direct,
            "is derived here, as in Megatron-LM, from the virtual pipeline flags",
            f"use {_VP_STAGES} (or {_VP_LAYERS})",
        )  # fmt: skip
    if per_stage is not None and stages is not None:
        return (
            _VP_LAYERS, per_stage, f"cannot be combined with {_VP_STAGES} = {stages} "
            f"{_AT_MOST_ONE}", "keep one of the two",
        )  # fmt: skip
    if per_stage is None and stages is None:
        return None
    flag, value = (_VP_STAGES, stages) if stages is not None else (_VP_LAYERS, per_stage)
    if a.get("pipeline_model_parallel_layout") is not None:
        return (
            flag, value, f"cannot be combined with --pipeline-model-parallel-layout "
            f"{_AT_MOST_ONE}", "keep one of the two",
        )  # fmt: skip
    first = a.get("num_layers_in_first_pipeline_stage")
    last = a.get("num_layers_in_last_pipeline_stage")
    num_layers = a["num_layers"]
    if per_stage is not None:
        if first is not None or last is not None:
            return (
                _VP_LAYERS, per_stage,
                "cannot be combined with --decoder-first/last-pipeline-num-layers (Megatron-LM)",
                f"with uneven stages give {_VP_STAGES}",
            )  # fmt: skip
        if num_layers % pp or (num_layers // pp) % per_stage:
            return (
                _VP_LAYERS, per_stage, "must divide the layers of each pipeline rank "
                f"(--num-layers = {num_layers} over --pipeline-model-parallel-size = {pp})",
                "use a divisor of num_layers / pp",
            )  # fmt: skip
        stages = num_layers // pp // per_stage
    if stages == 1:
        return None  # one chunk per rank: Megatron-LM's plain pipeline
    if pp == 1:
        return (
            flag, value, "needs --pipeline-model-parallel-size > 1 (the interleaved schedule "
            "runs model chunks over pipeline ranks)", "raise the pipeline size, or drop the flag",
        )  # fmt: skip
    if pp == 2 and not a["overlap_p2p_comm"]:
        return (
            "--no-overlap-p2p-communication", True, f"with {stages} virtual pipeline stages per "
            "rank needs --pipeline-model-parallel-size > 2 (Megatron-LM: two ranks would "
            "exchange several sends and receives in one batch)",
            "drop --no-overlap-p2p-communication",
        )  # fmt: skip
    group = a.get("microbatch_group_size_per_vp_stage")
    if group is not None and group < pp:
        return (
            "--microbatch-group-size-per-virtual-pipeline-stage", group,
            f"must be >= --pipeline-model-parallel-size = {pp}", None,
        )  # fmt: skip
    middle, middle_stages = num_layers, pp
    for name, layers in (("first", first), ("last", last)):
        if layers is not None:
            if layers % stages:
                return (
                    f"--decoder-{name}-pipeline-num-layers", layers,
                    f"must be divisible by the {stages} virtual pipeline stages per pipeline "
                    "rank", None,
                )  # fmt: skip
            middle, middle_stages = middle - layers, middle_stages - 1
    if middle_stages and middle % (middle_stages * stages):
        what = "pipeline rank" if middle_stages == pp else "middle pipeline rank"
        return (
            flag, value, f"each {what} holds {middle} / {middle_stages} of --num-layers = "
            f"{num_layers}: must split into {stages} model chunks of whole layers",
            "choose a number of virtual stages that divides each pipeline rank's layers",
        )  # fmt: skip
    return None


_FSDP2 = "--use-torch-fsdp2"


def _torch_fsdp2_rules(a: dict[str, Any], role: str | None) -> tuple:
    """Megatron-LM's rules for --use-torch-fsdp2 (arguments.py, core_v0.16.1; its
    --ckpt-format rule holds already: torch_dist is the only format here), and what is not
    verified with it here. Only a trained role is wrapped (`models.torch_fsdp2`)."""
    if not a.get("use_torch_fsdp2"):
        if a.get("torch_fsdp2_reshard_after_forward") is False:
            _note("--torch-fsdp2-no-reshard-after-forward is ignored without " + _FSDP2)
        return ()
    if role is not None and role not in ("train", "critic"):
        _note(f"{_FSDP2} is ignored for the forward-only role {role} (it wraps the "
                  "trained roles' models)")  # fmt: skip
        return ()
    off = f"is not supported with {_FSDP2}"
    drop = f"drop {_FSDP2} (DDP, with --use-distributed-optimizer to shard optimizer state)"
    return (
        (a["pipeline_model_parallel_size"] > 1, "--pipeline-model-parallel-size",
         a["pipeline_model_parallel_size"], off + " (Megatron-LM's rule)", "use 1, or " + drop),
        (a["expert_model_parallel_size"] > 1, "--expert-model-parallel-size",
         a["expert_model_parallel_size"], off + " (Megatron-LM's rule)", "use 1, or " + drop),
        (a["use_distributed_optimizer"], "--use-distributed-optimizer", True,
         off + ": FSDP2 shards the optimizer state itself (Megatron-LM's rule)", "drop it"),
        (a["gradient_accumulation_fusion"], "--gradient-accumulation-fusion", True,
         off + " (Megatron-LM's rule)", "add --no-gradient-accumulation-fusion"),
        (a["fp16"], "--fp16", True, off + " (Megatron-LM's rule)", "use --bf16, or " + drop),
        (role != "critic" and not a["untie_embeddings_and_output_weights"],
         "--untie-embeddings-and-output-weights", False,
         f"{_FSDP2} needs untied embeddings (Megatron-LM's rule: the embedding and the output "
         "layer are separate FSDP units), and model.hf_path ties them", drop),
        (a["tensor_model_parallel_size"] > 1, "--tensor-model-parallel-size",
         a["tensor_model_parallel_size"],
         off + " here: megatron-core 0.16.1 checkpoints a tensor-parallel shard of an FSDP2 "
         "parameter under wrong offsets (`make_tp_sharded_tensor_for_checkpoint`, SwiGLU's "
         "factory), and weight sync from it is not verified", "use 1, or " + drop),
        (a["context_parallel_size"] > 1, "--context-parallel-size", a["context_parallel_size"],
         off + " here (not verified)", "use 1, or " + drop),
        (a["num_experts"] is not None, "--num-experts", a["num_experts"],
         off + " here: MoE under FSDP2 is not verified (megatron-core's expert SwiGLU "
         "checkpoint factory has the row-shard defect `compat.megatron_fixes` names)", drop),
        (bool(a.get("check_weight_hash_across_dp_replicas_interval")),
         "--check-weight-hash-across-dp-replicas-interval",
         a.get("check_weight_hash_across_dp_replicas_interval"),
         off + ": FSDP2 shards each parameter over the data-parallel ranks, which hold no "
         "replicas to compare", "drop it"),
    )  # fmt: skip


_MTP = "--mtp-num-layers"
def layout_without_mtp(layout: str | None) -> str | None:
    """A --pipeline-model-parallel-layout with its MTP layers (`m`) left out, for a role that
    builds none (logp, ref); None stays None."""
    if layout is None:
        return None
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    symbols = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.loss: "L"}
    stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    return "|".join("".join(symbols[t] for t in stage if t is not LayerType.mtp)
                    for stage in stages)  # fmt: skip


def _layout_mtp_off_last_stage(layout: str, pp: int, num: int) -> bool:
    """Whether a layout leaves any of the `num` MTP layers out of its last stage (where they
    run here: the last stage's post-processing, not megatron-core's standalone MTP stage);
    False for a layout `_layout_rules` refuses."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        parsed = PipelineParallelLayerLayout(layout, pp)
    except (AssertionError, ValueError, SyntaxError, TypeError, NameError):
        return False
    return parsed.layout[-1][-1].count(LayerType.mtp) != num


def _mtp_rules(a: dict[str, Any], role: str | None) -> tuple:
    """Where multi-token prediction is built here: the actor (train role), its MTP layers on
    the last pipeline stage (any pipeline size, with a copy of the word embedding there tied to
    the first stage's: `compat.megatron_mtp`; in its last virtual stage, or where a pipeline
    layout puts them in the last stage: `tests/distributed/test_mtp.py`, on both ends of the
    supported megatron-core range), without context
    parallelism, under DDP or torch FSDP2 (`tests/distributed/test_mtp_fsdp2.py`); the logp
    and ref roles leave the MTP layers out (they compute the main head's log-probs only)."""
    num, factor = a.get("mtp_num_layers"), a.get("mtp_loss_scaling_factor")
    if num is None:
        if factor != 0.1:  # Megatron-LM's default
            _note(f"--mtp-loss-scaling-factor {factor} is ignored without {_MTP}")
        return ()
    if role in ("logp", "ref"):
        _note(f"{_MTP} {num} is ignored for the {role} role: its log-probs are the main "
                  "head's, and only the train role builds and trains the MTP layers")  # fmt: skip
        return ()
    with_mtp = f"with {_MTP} = {num} (multi-token prediction)"
    layout = a.get("pipeline_model_parallel_layout")
    return (
        (num < 1, _MTP, num, "must be >= 1", "drop the flag for no MTP layers"),
        (role in ("critic", "reward_model"), _MTP, num,
         f"multi-token prediction needs the LM output layer; the {role} role's scalar head "
         "replaces it", "set it in roles.train.megatron: only"),
        (factor is None or factor < 0, "--mtp-loss-scaling-factor", factor, "must be >= 0",
         None),
        (a["pipeline_model_parallel_size"] > 1
         and a["position_embedding_type"] == "learned_absolute" and a["add_position_embedding"],
         "--position-embedding-type", "learned_absolute",
         f"is not supported {with_mtp} and --pipeline-model-parallel-size > 1: the last "
         "stage's copy of the position embedding (the MTP layers') is not tied to the first "
         "stage's", "use rope, or --pipeline-model-parallel-size 1"),
        (layout is not None
         and _layout_mtp_off_last_stage(layout, a["pipeline_model_parallel_size"], num),
         "--pipeline-model-parallel-layout", layout,
         f"must place all {num} MTP layers ('m') in its last stage {with_mtp}: they run "
         "there, in the last stage's post-processing", "e.g. 'Et*3|t*4mL' for 7 layers and "
         "one MTP layer on 2 stages"),
        (a["context_parallel_size"] > 1, "--context-parallel-size", a["context_parallel_size"],
         f"must be 1 {with_mtp}: the MTP targets are shifted within this rank's sequence",
         f"use 1, or drop {_MTP}"),
    )  # fmt: skip


def _virtual_pipeline_rules(a: dict[str, Any], pp: int) -> tuple:
    problem = _virtual_pipeline_problem(a, pp)
    return () if problem is None else ((True, *problem),)


def check_args(args: dict[str, Any], role: str | None = None) -> None:
    """Cross-field rules on one role's resolved args, as Megatron-LM and megatron-core apply them.

    Errors name the flag to change; `role` (train, logp, ref) is added to the rule for context.
    """
    a = with_defaults(args)
    tp, ep, experts = (
        a["tensor_model_parallel_size"],
        a["expert_model_parallel_size"],
        a["num_experts"],
    )
    hidden, heads, groups = a["hidden_size"], a["num_attention_heads"], a["num_query_groups"]
    gqa, topk, lr, min_lr = a["group_query_attention"], a["moe_router_topk"], a["lr"], a["min_lr"]
    by_tp = f"must be divisible by --tensor-model-parallel-size = {tp}"
    # (broken, flag, value, rule, hint); the first broken rule is reported.
    arch_hint = "set model.hf_path (its config.json gives the architecture) or pass the flag"
    rules = (
        (hidden is None, "--hidden-size", None, "is required", arch_hint),
        (heads is None, "--num-attention-heads", None, "is required", arch_hint),
        (a["num_layers"] is None, "--num-layers", None, "is required", arch_hint),
        (
            role in ("train", "critic") and lr is None,
            "--lr",
            None,
            f"the {role} role needs a learning rate",
            "set it in roles.critic.megatron: (the critic has its own)" if role == "critic"
            else None,
        ),
        (a["bf16"] and a["fp16"], "--fp16", True, "cannot be combined with --bf16", None),
        (
            hidden and heads and a["kv_channels"] is None and hidden % heads,
            "--hidden-size",
            hidden,
            f"must be divisible by --num-attention-heads = {heads}",
            "or set --kv-channels explicitly",
        ),
        (heads and heads % tp, "--num-attention-heads", heads, by_tp, None),
        (gqa and groups is None, "--num-query-groups", None, "needs a value with GQA", None),
        (
            gqa and groups and heads and heads % groups,
            "--num-query-groups",
            groups,
            f"must divide --num-attention-heads = {heads}",
            None,
        ),
        (gqa and groups and groups % tp, "--num-query-groups", groups, by_tp, None),
        (
            experts is None and ep > 1,
            "--expert-model-parallel-size",
            ep,
            "needs --num-experts",
            None,
        ),
        (
            experts and experts % ep,
            "--num-experts",
            experts,
            f"must be divisible by --expert-model-parallel-size = {ep}",
            None,
        ),
        (
            experts and topk > experts,
            "--moe-router-topk",
            topk,
            f"must be <= {experts} experts",
            None,
        ),
        (
            experts and tp > 1 and not a["sequence_parallel"],
            "--sequence-parallel",
            False,
            f"MoE with --tensor-model-parallel-size = {tp} needs sequence parallelism",
            "add --sequence-parallel",
        ),
        (
            lr is not None and min_lr is not None and min_lr > lr,
            "--min-lr",
            min_lr,
            f"must be <= --lr = {lr}",
            None,
        ),
    )
    freq = a["moe_layer_freq"]
    rules += (
        (
            experts is not None and isinstance(freq, list) and len(freq) != a["num_layers"],
            "--moe-layer-freq",
            freq,
            f"a pattern needs one 0 (dense) or 1 (MoE) per layer: {a['num_layers']} of them",
            None,
        ),
    )
    pp = a["pipeline_model_parallel_size"]
    rules += _virtual_pipeline_rules(a, pp)
    rules += _layout_rules(a, pp)
    rules += _torch_fsdp2_rules(a, role)
    rules += _mtp_rules(a, role)
    rules += tuple(
        (
            pp > 1 and a.get(name),
            "--" + name.replace("_", "-"),
            True,
            "is not mapped by the HF weight names here (a stage's layers would be misplaced)",
            "use --decoder-first/last-pipeline-num-layers for uneven stages",
        )
        for name in (
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        )
    )
    rules += (
        (
            not a["add_position_embedding"] and a["position_embedding_type"] != "rope",
            "--no-position-embedding",
            True,
            "is deprecated in Megatron-LM (refused there without RoPE)",
            "use --position-embedding-type none (or rope)",
        ),
    )
    where = f" (resolved for role {role})" if role else ""
    for broken, flag, value, rule, hint in rules:
        if broken:
            raise ConfigError(flag, value, rule + where, hint)
    if groups is not None and not gqa:
        _note(f"--num-query-groups {groups} is ignored without --group-query-attention{where}")
    if a["sequence_parallel"] and tp == 1:
        _note(f"--sequence-parallel is ignored with --tensor-model-parallel-size 1{where}")
