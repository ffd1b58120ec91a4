"""What this trainer does with each of Megatron-LM's flags: the tables behind the verdicts.

Owned here: `ALIASES` (Megatron-LM spellings of an applied dest, value translated), `IGNORED` and
`IGNORED_GROUPS` (accepted, listed in one warning line with the reason), `RECIPE_ALIASES`
(dests whose owner is a recipe key), `REFUSED`, `REFUSED_GROUPS`, `REFUSED_VALUES`,
`REFUSED_CHOICES` and `NOT_BUILT` (an error with the reason and a fix), `ONLY_WITH` and
`INERT_HERE`. `config.megatron.inventory.classify` reads them into one verdict per dest; the
tables hold the dests of every supported release (a dest one release lacks is never looked up
there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_async_rl.config.errors import ConfigError

# --- aliases: Megatron-LM dest -> (what it sets here, translation of its value) --------------
Alias = tuple[str, Callable[[Any], dict[str, Any]]]


def _when(condition: Callable[[Any], bool], values: dict[str, Any]) -> Callable:
    return lambda value: dict(values) if condition(value) else {}


def _no_gloo_groups(dest: str) -> Callable[[Any], dict[str, Any]]:
    """--disable-gloo-process-groups is how roles build their distributed optimizer already
    (its dest: enable_gloo_process_groups to 0.16, use_gloo_process_groups from 0.17)."""

    def translate(value: Any) -> dict[str, Any]:
        if value:
            raise ConfigError(
                dest, value,
                "the distributed optimizer here uses the role's own groups, never gloo copies",
                "drop it (Megatron-LM's --disable-gloo-process-groups is the behaviour)",
            )  # fmt: skip
        return {}

    return translate


def _torch_dist_only(value: Any) -> dict[str, Any]:
    if value != "torch_dist":
        raise ConfigError(
            "--ckpt-format", value,
            "checkpoints here are megatron-core dist_checkpointing in torch_dist format",
            "drop it, or write --ckpt-format torch_dist",
        )  # fmt: skip
    return {}


ALIASES: dict[str, Alias] = {
    "ckpt_format": ("torch_dist, the only format here", _torch_dist_only),
    "finetune": (
        "weights only from --load / model.hf_path, how every run starts (resume: checkpoint:)",
        lambda v: {},
    ),
    "use_checkpoint_args": (
        "the architecture from model.hf_path's config.json, how every run reads it",
        lambda v: {},
    ),
    "layernorm_epsilon": ("--norm-epsilon", lambda v: {"norm_epsilon": v}),
    "encoder_num_layers": ("--num-layers", lambda v: {"num_layers": v}),
    "recompute_activations": (
        "--recompute-granularity selective",
        _when(bool, {"recompute_granularity": "selective"}),
    ),
    "bias_gelu_fusion": ("bias_activation_fusion", lambda v: {"bias_activation_fusion": v}),
    "bias_swiglu_fusion": ("bias_activation_fusion", lambda v: {"bias_activation_fusion": v}),
    "no_persist_layer_norm": ("persist_layer_norm", lambda v: {"persist_layer_norm": not v}),
    "use_flash_attn": ("--attention-backend flash", _when(bool, {"attention_backend": "flash"})),
    "use_rotary_position_embeddings": (
        "--position-embedding-type rope",
        _when(bool, {"position_embedding_type": "rope"}),
    ),
    "decoder_first_pipeline_num_layers": (
        "num_layers_in_first_pipeline_stage",
        lambda v: {"num_layers_in_first_pipeline_stage": v},
    ),
    "decoder_last_pipeline_num_layers": (
        "num_layers_in_last_pipeline_stage",
        lambda v: {"num_layers_in_last_pipeline_stage": v},
    ),
    "ddp_bucket_size": ("DDP bucket_size", lambda v: {"bucket_size": v}),
    "ddp_pad_buckets_for_high_nccl_busbw": (
        "DDP pad_buckets_for_high_nccl_busbw",
        lambda v: {"pad_buckets_for_high_nccl_busbw": v},
    ),
    "ddp_reduce_scatter_with_fp32_accumulation": (
        "DDP reduce_scatter_with_fp32_accumulation",
        lambda v: {"reduce_scatter_with_fp32_accumulation": v},
    ),
    "ddp_average_in_collective": (
        "DDP average_in_collective",
        lambda v: {"average_in_collective": v},
    ),
    "accumulate_allreduce_grads_in_fp32": (
        "DDP grad_reduce_in_fp32",
        lambda v: {"grad_reduce_in_fp32": v},
    ),
    "grad_reduce_in_bf16": (
        "DDP grad_reduce_in_fp32 false",
        _when(bool, {"grad_reduce_in_fp32": False}),
    ),
    "check_for_nan_in_loss_and_grad": (
        "DDP check_for_nan_in_grad",
        lambda v: {"check_for_nan_in_grad": v},
    ),
    **{
        dest: ("gloo groups off, the only mode here", _no_gloo_groups(dest))
        for dest in ("enable_gloo_process_groups", "use_gloo_process_groups")
    },
    "te_rng_tracker": ("use_te_rng_tracker", lambda v: {"use_te_rng_tracker": v}),
    "no_weight_decay_cond_type": (
        "--apply-wd-to-qk-layernorm",
        lambda v: {"apply_wd_to_qk_layernorm": v == "apply_wd_to_qk_layernorm"},
    ),
    "deprecated_use_mcore_models": (
        "megatron-core models (the only kind built here)",
        lambda v: {},
    ),
}

# --- ignored: accepted, reported in one warning line with the reason --------------------------
_DATA = "pretraining data (prompts come from the recipe's data: section)"
_TOKENIZER = "tokenizer (the HF tokenizer of model.hf_path is used)"
_LOGGING = "logging destinations (metrics go to <run_dir>/metrics.jsonl and the plots)"
_PROFILING = "profiling (the run writes timeline.png and trace.json)"
_VALIDATION = "pretraining validation (the recipe's validation: section sets evaluation)"
_CHECKPOINT = (
    "checkpoint format and cadence (the recipe's checkpoint: section: megatron-core "
    "dist_checkpointing, fully reshardable, saved at policy-version boundaries)"
)
_INFERENCE = "Megatron-LM's inference engine (generation runs in SGLang: the engine: section)"
_MONITORING = "cluster-service integrations and debug monitors of Megatron-LM's training loop"
_OTHER_MODELS = "other model families (BERT, T5, vision, retrieval); this trainer builds GPT models"

IGNORED_GROUPS = {
    "data and dataloader": _DATA,
    "tokenizer": _TOKENIZER,
    "logging": _LOGGING,
    "profiling": _PROFILING,
    "validation": _VALIDATION,
    "checkpointing": _CHECKPOINT,
    "inference": _INFERENCE,
    "straggler": _MONITORING,
    "workload inspector": _MONITORING,
    "one logger": _MONITORING,
    "In-process restart": _MONITORING,
    "ft_package": _MONITORING,
    "rerun engine": _MONITORING,
    "msc": _MONITORING,
    "autoresume": _MONITORING,
    "biencoder": _OTHER_MODELS,
    "vision": _OTHER_MODELS,
}

IGNORED: dict[str, str] = {
    "decoder_num_layers": _OTHER_MODELS,
    "relative_attention_num_buckets": _OTHER_MODELS,
    "relative_attention_max_distance": _OTHER_MODELS,
    "bert_binary_head": _OTHER_MODELS,
    "onnx_safe": "ONNX export",
    "openai_gelu": "unused by Megatron-LM's megatron-core models too",
    "moe_pad_experts_for_cuda_graph_inference": _INFERENCE,
    "enable_experimental": "Megatron-LM's gate for its experimental paths (none exist here)",
    "data_parallel_random_init": "random init per data-parallel rank (weights load from HF)",
    "exit_signal_handler_for_dataloader": _DATA,
    "result_rejected_tracker_filename": _MONITORING,
    "dataloader_type": _DATA,
    "local_rank": "the local rank (torchrun's LOCAL_RANK is used)",
    "scatter_gather_tensors_in_pipeline": "a no-op in megatron-core models",
    "distributed_backend": "the backend (nccl on GPUs, gloo on CPU: platform.device)",
    "cache_mla_latents": "the KV cache of Megatron-LM's own inference engine (the SGLang "
    "engines keep their own MLA cache)",
    "eval_iters": _VALIDATION,
    "sft": "supervised fine-tuning data (RL prompts come from the data: section)",
    "sft_tokenizer_prompt_format": _TOKENIZER,
    "padded_vocab_size": _TOKENIZER,
}

# --- recipe aliases: Megatron-LM dests whose owner is a key of this trainer's recipe ----------
# A flag sets the key (flags have the highest precedence); a recipe that sets the key to another
# value is an error (one owner per knob). Inside a recipe's megatron: section they are refused
# with the key to write instead.
RECIPE_ALIASES = {
    "async_save": "checkpoint.async_save",
    "distributed_backend": "platform.backend",
    "grpo_group_size": "algorithm.num_samples_per_prompt",
    "grpo_prompts_per_step": "rollout.num_prompts_per_step",
    "grpo_iterations": "algorithm.ppo_epochs",
    "grpo_kl_beta": "algorithm.kl_coef",
    "grpo_clamp_eps_lower": "algorithm.clip_ratio_low",
    "grpo_clamp_eps_upper": "algorithm.clip_ratio_high",
    "grpo_entropy_term_weight": "algorithm.entropy_coef",
    "grpo_filter_groups_with_same_reward": "algorithm.dynamic_filtering",
    "rl_default_temperature": "rollout.temperature",
    "rl_default_top_p": "rollout.top_p",
    "rl_default_top_k": "rollout.top_k",
    "rl_inference_tensor_model_parallel_size": "engine.tp_size",
    "rl_importance_sampling_truncation_coef": "algorithm.tis_cap",
    "moe_enable_routing_replay": "moe.routing_replay",
    # The loss over the step's tokens (Megatron-LM's per-token loss) is this recipe's token-mean;
    # megatron-core's own per-token mode is never set: it expects Megatron-LM's loss function
    # and would rescale the MoE auxiliary losses by each micro-batch's tokens (measured: the
    # z-loss gradient 96x too large with 4 micro-batches of 24 tokens).
    "calculate_per_token_loss": "algorithm.loss_agg_mode",
}
RECIPE_ALIAS_VALUES = {
    "moe_enable_routing_replay": lambda on: "r3" if on in (True, None, "true", "True") else "off",
    "calculate_per_token_loss": lambda on: "token-mean",  # a switch: given means on
}
"""Flag values that the recipe key spells otherwise (a switch that names a mode)."""

# --- refused: an error with the reason and what to write instead -------------------------------

REFUSED: dict[str, tuple[str, str]] = {
    "batch_size": ("is no longer valid in Megatron-LM either", "use --micro-batch-size"),
    "warmup": ("is no longer valid in Megatron-LM either", "use --lr-warmup-iters"),
    "model_parallel_size": (
        "is no longer valid in Megatron-LM either",
        "use --tensor-model-parallel-size",
    ),
    "checkpoint_activations": (
        "is no longer valid in Megatron-LM either",
        "use --recompute-activations or --recompute-granularity",
    ),
    "use_legacy_models": ("legacy (non-core) models are not built here", "drop the flag"),
    "lazy_mpu_init": ("lazy model-parallel init is not supported", "drop the flag"),
    "create_all_gather_group": (
        "megatron-core 0.16.1 reads the separate all-gather group from its global parallel "
        "state only, which roles (built from explicit process groups) do not use",
        "drop the flag",
    ),
    "enable_full_sharding_in_hsdp": ("HSDP is not supported", "drop the flag"),
    "fake_process_group": ("fake process groups are for benchmarking Megatron-LM", "drop it"),
    "heterogeneous_layers_config_path": ("heterogeneous layer configs are not built", "drop it"),
    "heterogeneous_layers_config_encoded_json": (
        "heterogeneous layer configs are not built",
        "drop it",
    ),
    "tp_comm_overlap_cfg": (
        "Transformer Engine userbuffers are not initialised by this trainer",
        "drop the flag",
    ),
    "te_precision_config_file": ("per-module TE precision configs are not applied", "drop it"),
    "spec": ("custom layer specs are not loaded here", "drop the flag"),
    **{
        name: ("precision-aware optimizer dtypes are not applied here", "drop the flag")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    },
    "yaml_cfg": ("Megatron-LM's YAML configs are not read", "use this trainer's recipe file"),
    "hybrid_attention_ratio": ("hybrid Mamba models are not built here", "drop the flag"),
    "hybrid_mlp_ratio": ("hybrid Mamba models are not built here", "drop the flag"),
    "hybrid_override_pattern": ("hybrid Mamba models are not built here", "drop the flag"),
}

IGNORED_GROUPS["rl"] = (
    "Megatron-LM's own RL loop (its environments, inference engine, sequence packing, CUDA "
    "graphs); the recipe's data:, reward:, engine: and algorithm: sections replace it"
)

REFUSED_GROUPS = {
    "Logits Distillation": ("distillation is not supported", "drop the flag"),
}


NOT_KNOBS_IN_MEGATRON_LM = {
    "batch_size": "Megatron-LM rejects it",
    "warmup": "Megatron-LM rejects it",
    "model_parallel_size": "Megatron-LM rejects it",
    "checkpoint_activations": "Megatron-LM rejects it",
    "bert_binary_head": "read for BERT models only",
    "decoder_num_layers": "read for T5 models only",
    "relative_attention_num_buckets": "read for T5 models only",
    "relative_attention_max_distance": "read for T5 models only",
    "openai_gelu": "read nowhere in Megatron-LM core_v0.16.1",
    "scatter_gather_tensors_in_pipeline": "a no-op for megatron-core models",
    "local_rank": "set by the launcher, not by users",
    "moe_extended_tp": "deprecated, read nowhere",
    "async_tensor_model_parallel_allreduce": "deprecated, read nowhere",
    **{name: "read by hybrid Mamba models only" for name in (
        "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim",
        "use_mamba_mem_eff_path", "is_hybrid_model", "mtp_hybrid_override_pattern",
        "mamba_training_ssm_states_dtype",
    )},
}  # fmt: skip
"""Flags of Megatron-LM that configure nothing in a GPT run there either (for the coverage
figure's second denominator; their verdicts above stand)."""


NOT_BUILT: dict[str, tuple[str, str]] = {}
"""Megatron-core config fields of model structures the HF name map does not cover yet: refused
before they reach a config, since a model built with them could not load or sync its weights."""


def _on(value: Any) -> bool:
    return bool(value)


def _set(value: Any) -> bool:
    return value is not None


_FSDP = (
    "Megatron FSDP cannot wrap a role here: megatron-core's adapter lays its device mesh over "
    "the whole world, engine ranks included (0.16.1 and 0.19.2: an einops shape mismatch at wrap "
    "time, given the role's groups), and 0.16.1's also reads the global tensor-parallel group, "
    "which roles built from explicit groups never initialise (an AssertionError on an H100; "
    "0.19.2 takes the role's groups; tests/distributed/test_megatron_fsdp_refusal.py)"
)
_GRAPHS = (
    "CUDA graphs (Megatron-LM's RL loop captures its inference engine with them and trains "
    "without unless --rl-training-cuda-graphs; the SGLang engines here capture their own, and "
    "megatron-core's per-layer graph manager reads its global parallel state, which roles built "
    "from explicit groups do not initialise: an AssertionError at model build, on an H100 with "
    "0.16.1; 0.19.2's manager takes groups but no layer passes it any, its Transformer Engine "
    "graphs need a training loop to capture them and its full-iteration graphs barrier the whole "
    "world; tests/unit/test_cuda_graph_refusal.py)"
)

REFUSED_VALUES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "use_megatron_fsdp": (
        _on, _FSDP,
        "use --use-torch-fsdp2 (parameters, gradients and optimizer state sharded) or "
        "--use-distributed-optimizer",
    ),
    "num_distributed_optimizer_instances": (
        lambda v: v is not None and int(v) > 1,
        "several distributed-optimizer instances need an inter-instance group, which the role "
        "groups do not build (one instance shards over the role's data-parallel ranks)",
        "drop the flag (1 instance)",
    ),
    "tp_comm_overlap": (
        _on,
        "Transformer Engine's userbuffers are not initialised here; they also need one fixed "
        "sequence length per micro-batch, while RL batches are padded to their longest sample",
        "drop the flag",
    ),
    "experimental_attention_variant": (
        _set,
        "experimental attention variants (gated delta net, DSA) are not built by the layer "
        "specs here, and the HF name map has no names for their weights",
        "drop the flag",
    ),
    "pipeline_model_parallel_comm_backend": (
        lambda v: v not in (None, "nccl"),
        "pipeline groups are created with the platform's backend (nccl on GPUs, gloo on CPU)",
        "drop the flag",
    ),
}
"""Dests that reach a megatron-core config field but whose meaning is built by Megatron-LM's own
training loop or model builders, which this trainer does not run: a value that asks for it is
refused (the default passes). Classified refused: no value of theirs does anything here."""

ONLY_WITH: dict[str, str] = {
    **{name: "use_megatron_fsdp" for name in (
        "data_parallel_sharding_strategy", "outer_dp_sharding_strategy", "fsdp_double_buffer",
        "fsdp_manual_registration", "suggested_communication_unit_size",
        "keep_fp8_transpose_cache",
    )},
    **{name: "tp_comm_overlap" for name in (
        "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs",
        "tp_comm_bootstrap_backend",
    )},
    **{name: "hybrid_override_pattern" for name in (
        "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim",
        "use_mamba_mem_eff_path", "is_hybrid_model",
    )},
    **{name: "experimental_attention_variant" for name in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "linear_value_head_dim", "dsa_indexer_head_dim",
        "dsa_indexer_loss_coeff", "dsa_indexer_n_heads", "dsa_indexer_topk",
        "dsa_indexer_use_sparse_loss",
    )},
}  # fmt: skip
"""Dests read only by a structure whose own flag is refused here: they configure nothing (as in
Megatron-LM without that flag), so they are ignored with that reason, in the one warning line."""

INERT_HERE: dict[str, str] = {
    **{name: _GRAPHS for name in (
        "cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph", "cuda_graph_warmup_steps",
        "cuda_graph_scope",
    )},
    **{name: "deprecated: read nowhere by megatron-core 0.16.1 or Megatron-LM's GPT path"
       for name in ("moe_extended_tp", "async_tensor_model_parallel_allreduce")},
    "mtp_standalone": (
        "megatron-core 0.16.1 derives it from --pipeline-model-parallel-layout (MTP layers in a "
        "pipeline stage of their own) and reads it only to exchange tensor shapes between "
        "pipeline stages; MTP is built here with one pipeline stage (--mtp-num-layers)"
    ),
}
"""Dests that reach a config field nothing here reads: ignored with the reason."""

# --- flags new in megatron-core 0.17 to 0.19 (Megatron-LM core_v0.17.1 to core_v0.19.0) -------
# Their config fields that work as those of 0.16 do (MoE dispatcher and offloading knobs, the
# Muon and Lion hyperparameters, ...) are applied like every config field; the rest follow.
_DROP = "drop the flag"
_UNNAMED = (
    "which the HF name map here (weight load, weight sync to the engines, export) does not name"
)
_ENGINES_DIFFER = "so generation in the SGLang engines would not compute what training does"
_MUP = (
    "muP scales the embedding output, the logits and the attention softmax; the HF model the "
    f"SGLang engines run has none of these multipliers, {_ENGINES_DIFFER}"
)
_GTP = (
    "generalized tensor parallelism (each weight sharded further, over a rematerialization axis) "
    "takes its groups from megatron-core's global parallel state, which roles built from "
    "explicit groups do not initialise, and the weight sync here reads tensor-parallel shards only"
)
REFUSED_VALUES.update({
    "use_transformer_engine_op_fuser": (
        _on, "builds experts and MLPs from Transformer Engine's fusible ops, whose parameters "
        + _UNNAMED, _DROP,
    ),
    "mla_down_proj_fusion": (
        _on, "fuses MLA's q and kv down-projections (and the input layernorm) into one "
        "parameter, " + _UNNAMED + " (it maps q_a_proj and kv_a_proj_with_mqa apart)", _DROP,
    ),
    **{name: (_on, "stores every expert's weights as one grouped parameter, " + _UNNAMED
              + " (it names one weight per expert)", _DROP)
       for name in ("moe_single_grouped_weight", "moe_single_grouped_bias")},
    **{name: (_on, f"builds the {what} as a one-group GroupedLinear, whose parameter "
              + _UNNAMED, _DROP)
       for name, what in (("use_grouped_gemm_for_dense_mlp", "dense MLP"),
                          ("use_grouped_gemm_for_shared_expert", "shared-expert MLP"))},
    **{name: (_set, "lays the gate and up projections out in interleaved blocks; the HF name "
              "map here writes linear_fc1 as [gate; up]", _DROP)
       for name in ("moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size")},
    "mtp_use_repeated_layer": (
        _on, "applies one MTP layer at every depth; HF checkpoints and the name map here hold "
        "one layer per depth", "drop the flag (one layer per --mtp-num-layers)",
    ),
    "mtp_detach_heads": (
        _on, "the MTP loss here comes from compat.megatron_mtp's loss hook through the shared "
        "output layer, which it does not detach as megatron-core's own MTP loss does: the MTP "
        "gradients would still reach the main model", _DROP,
    ),
    **{name: (_set, _GTP, "drop the flag (weights sharded over the tensor-parallel ranks)")
       for name in ("tensor_parallel_num_weight_shards",
                    "expert_tensor_parallel_num_weight_shards")},
    "use_mup": (_on, _MUP, _DROP),
    "mup_output_mult": (
        lambda v: v is not None and float(v) != 1.0,
        "scales the logits (read without --use-mup too); " + _MUP, _DROP,
    ),
    "moe_router_force_biased": (
        _set, "adds a random bias to the router logits (Megatron-LM's benchmarking aid); the "
        f"engines route without it, {_ENGINES_DIFFER}", _DROP,
    ),
    "moe_paged_stash": (
        _on, "needs Megatron-LM's training loop (its PagedStashRunner sizes and resets the "
        "stash buffers), which this trainer does not run", _DROP,
    ),
})  # fmt: skip

REFUSED_CHOICES: dict[str, dict[Any, tuple[str, str]]] = {
    "moe_router_load_balancing_type": {"quantile_balancing": (
        "routes with a per-expert bias (qb_beta) that megatron-core updates every step; the HF "
        f"model the SGLang engines run has no such bias, {_ENGINES_DIFFER}",
        "use aux_loss, seq_aux_loss, global_aux_loss or none (--moe-router-enable-expert-bias "
        "is the routing bias the engines share)",
    )},
}  # fmt: skip
"""Values of applied dests that ask for what is not built here (the dest stays applied)."""

REFUSED.update({
    "hybrid_layer_pattern": ("hybrid Mamba models are not built here", _DROP),
    "step_batch_size_schedule": (
        "Megatron-LM's batch-size schedule is not applied here",
        "use --rampup-batch-size (applied: algorithms/batch_ramp.py)",
    ),
    "freeze_all_layers": ("freezing every layer is not supported (the train role trains)", _DROP),
    "ddp_param_name_patterns_for_fp32_local_accumulation": (
        "FP32 local gradient accumulation for chosen parameters is not applied here",
        "drop it, or give --accumulate-allreduce-grads-in-fp32 (every parameter)",
    ),
})  # fmt: skip
IGNORED_GROUPS["fault injector"] = _MONITORING
IGNORED.update({
    **{name: _MONITORING for name in (
        "flight_recorder_dump_path", "flight_recorder_trace_buffer_size",
        "flight_recorder_dump_on_timeout", "flight_recorder_include_stack_trace",
        "flight_recorder_include_only_active", "flight_recorder_extra_dump_on_exec",
        "gpu_sniff_test_interval",
    )},
    "exit_signal_handler_for_training": (
        "Megatron-LM's quiet exit on SIGINT or SIGTERM (signals here: checkpoint.save_on_signal)"
    ),
    "use_layer_wise_param_layout": (
        "the parameter layout of Megatron-LM's layer-wise distributed optimizer, which its "
        "training loop builds"
    ),
})  # fmt: skip
ONLY_WITH.update({
    **{name: "use_megatron_fsdp" for name in (
        "megatron_fsdp_enable_fine_grained_param_gather", "megatron_fsdp_max_pool_double_buffer",
        "fsdp_db_use_persist_buf_on_alloc_fail", "megatron_fsdp_main_params_dtype",
        "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype",
    )},
    **{name: "use_mup" for name in (
        "mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult", "mup_base_head_dim",
        "mup_attn_scale_power",
    )},
    **{name: "experimental_attention_variant" for name in (
        "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "dsa_kernel_backend",
        "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32",
    )},
    **{name: "hybrid_layer_pattern" for name in (
        "mtp_hybrid_override_pattern", "mamba_training_ssm_states_dtype",
    )},
    **{name: "moe_paged_stash" for name in (
        "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
        "moe_paged_stash_buffer_size_factor_cpu",
    )},
})  # fmt: skip
INERT_HERE.update({
    **{name: _GRAPHS for name in (
        "cuda_graph_modules", "cuda_graph_scope_deprecated", "delay_offload_until_cuda_graph",
    )},
    "optimizer_cuda_graph": (
        "a CUDA graph of the optimizer step, captured by Megatron-LM's training loop "
        "(OptimizerCudaGraphWrapper), which this trainer does not run"
    ),
    **{name: _INFERENCE for name in (
        "moe_pad_experts_for_cuda_graph_inference", "nccl_all_reduce_for_prefill",
        "inference_cuda_graph_scope", "inference_disable_triton_nvls_kernels",
        "inference_grouped_gemm_backend", "inference_moe_disable_fused_quant_kernels",
        "inference_moe_token_dispatcher_type",
    )},
    **{name: "YaRN RoPE of non-MLA models (--position-embedding-type yarn), not built here "
             "(MLA models read --rotary-scaling-factor, --mscale, ...)"
       for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast",
                    "yarn_beta_slow", "yarn_correction_range_round_to_int")},
    "moe_router_quantile_balancing_ema": (
        "read only with --moe-router-load-balancing-type quantile_balancing, refused here"
    ),
})  # fmt: skip
