"""megatron-core constructor kwargs from a role's resolved Megatron args.

Owned here: `transformer_config_class` and `transformer_config_kwargs` (the role's
`TransformerConfig` or `MLATransformerConfig`, aliases translated as Megatron-LM's
`core_transformer_config_from_args` does), `optimizer_config_kwargs`, `ddp_config_kwargs`,
`gpt_model_kwargs` and `virtual_stages`. The args are dest-keyed dicts (`config.megatron.table`
types and defaults them). Callers: `models.builder` and `roles`. megatron-core and torch are
imported inside the builders, so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_async_rl.config.megatron.table import with_defaults


def _accepted(cls: type, args: dict[str, Any]) -> dict[str, Any]:
    """The entries of args that `cls` takes; None is dropped where the field's default is not."""
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.init and field.name in args:
            value = args[field.name]
            if value is None and field.default is not None:
                continue
            kwargs[field.name] = value
    return kwargs


def _params_dtype(args: dict[str, Any]) -> Any:
    import torch

    return torch.bfloat16 if args["bf16"] else torch.float16 if args["fp16"] else torch.float32


def transformer_config_class(args: dict[str, Any]) -> type:
    """`MLATransformerConfig` with --multi-latent-attention, else `TransformerConfig`."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if args.get("multi_latent_attention") else TransformerConfig


def transformer_config_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """kwargs for the role's transformer config class, aliases translated as Megatron-LM's
    `core_transformer_config_from_args` does (activations, init, enums, tuples)."""
    import torch
    from megatron.core.activations import quick_gelu, squared_relu
    from megatron.core.transformer.enums import AttnBackend

    args = with_defaults(args)
    kwargs = _accepted(transformer_config_class(args), args)
    kwargs["layernorm_epsilon"] = args["norm_epsilon"]
    if args["num_experts"] is not None:
        kwargs["num_moe_experts"] = args["num_experts"]
    if args["swiglu"]:
        kwargs["gated_linear_unit"] = True
        kwargs["activation_func"] = torch.nn.functional.silu
    elif args["squared_relu"]:
        kwargs["activation_func"] = squared_relu
    elif args["quick_geglu"]:
        kwargs["gated_linear_unit"] = True
        kwargs["activation_func"] = quick_gelu
    if args["init_method_xavier_uniform"]:
        kwargs["init_method"] = torch.nn.init.xavier_uniform_
        kwargs["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    if not args["group_query_attention"]:
        kwargs["num_query_groups"] = None  # Megatron-LM ignores --num-query-groups without GQA
    kwargs["attention_backend"] = AttnBackend[args["attention_backend"]]
    # "full" (every default), without its deprecation: 0.16's cuda_graph_scope, renamed
    # cuda_graph_modules by 0.19 (which warns on the old name)
    fields = {f.name for f in dataclasses.fields(transformer_config_class(args))}
    graphs = "cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope"
    if kwargs.get(graphs) in (None, "full"):
        kwargs[graphs] = []
    for name in ("window_size",):
        if args[name] is not None:
            kwargs[name] = tuple(args[name])
    for name in ("hierarchical_context_parallel_sizes", "recompute_modules", "mrope_section",
                 "offload_modules"):  # fmt: skip
        if args[name] is not None:
            kwargs[name] = list(args[name])
    kwargs["moe_layer_freq"] = args["moe_layer_freq"]
    if args["fp8_param_gather"]:
        kwargs["fp8_param"] = True
    if args.get("fp4_param_gather"):  # from 0.17 a DDP field too; Megatron-LM sets both
        kwargs["fp4_param"] = True
    kwargs["params_dtype"] = kwargs["pipeline_dtype"] = _params_dtype(args)
    vp = virtual_stages(args)
    kwargs["virtual_pipeline_model_parallel_size"] = vp if vp > 1 else None
    if vp > 1:  # Megatron-LM: batched p2p ops only without the overlap
        kwargs["batch_p2p_comm"] = not kwargs["overlap_p2p_comm"]
    else:  # Megatron-LM: the non-interleaved schedule does not overlap p2p communication
        kwargs["overlap_p2p_comm"] = False
    return kwargs


def virtual_stages(args: dict[str, Any]) -> int:
    """Model chunks per pipeline rank (V; 1 without virtual pipeline stages), as Megatron-LM
    derives its virtual_pipeline_model_parallel_size: --num-virtual-stages-per-pipeline-rank, or
    the layers of a pipeline rank over --num-layers-per-virtual-pipeline-stage
    (`rules.check_args` has checked both). With pp = 1 the model is one chunk."""
    pp = args.get("pipeline_model_parallel_size") or 1
    if pp == 1:
        return 1
    if args.get("num_virtual_stages_per_pipeline_rank"):
        return int(args["num_virtual_stages_per_pipeline_rank"])
    per_stage = args.get("num_layers_per_virtual_pipeline_stage")
    if per_stage:
        return int(args["num_layers"]) // pp // int(per_stage)
    return 1


def optimizer_config_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """kwargs for `megatron.core.optimizer.OptimizerConfig`."""
    from megatron.core.optimizer import OptimizerConfig

    args = with_defaults(args)
    kwargs = _accepted(OptimizerConfig, args)
    kwargs["params_dtype"] = _params_dtype(args)
    return kwargs


def ddp_config_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """kwargs for `megatron.core.distributed.DistributedDataParallelConfig`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return _accepted(DistributedDataParallelConfig, with_defaults(args))


def gpt_model_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """The GPTModel constructor arguments that come from Megatron flags (vocab_size may be None)."""
    args = with_defaults(args)
    return {
        "position_embedding_type": args["position_embedding_type"],
        "rotary_base": args["rotary_base"],
        "rotary_percent": args["rotary_percent"],
        "share_embeddings_and_output_weights": not args["untie_embeddings_and_output_weights"],
        "max_sequence_length": args["max_position_embeddings"] or args["seq_length"],
        "rope_scaling": args["use_rope_scaling"],
        "rope_scaling_factor": args["rope_scaling_factor"],
        "seq_len_interpolation_factor": args["rotary_seq_len_interpolation_factor"],
        "vocab_size": args["vocab_size"],
    }
