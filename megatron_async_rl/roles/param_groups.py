"""The train role's optimizer parameter groups, written where --dump-param-to-param-group-map asks.

Owned here: `dump_param_to_param_group_map`, called by `roles.megatron_wrap.wrap_for_training` right
after `get_megatron_optimizer` when the role's args set the flag, on every rank of the role.

What Megatron-LM writes (core_v0.16.1, `get_megatron_optimizer`): a torch.distributed.checkpoint
(DCP) directory at the flag's path, whose state dict maps the global unique name of each
parameter the optimizer updates to the index of its parameter group, the groups numbered as the
chained optimizer lists them (`optimizer.param_groups`: the dense groups, then the
expert-parallel ones; a group with no parameter on some rank keeps its number, megatron-core
aligns the groups across ranks). A global unique name is the parameter's name in the model chunk
(`module.` first: the DDP wrapper) with its global layer index (`layer_number - 1` of its
`TransformerLayer`; MTP layers keep theirs) and its global expert index (local index + EP rank x
local experts). One deliberate difference: with several model chunks (virtual pipeline stages)
megatron-core 0.16.1 finds the layer in the last chunk only, so the other chunks' parameters keep
chunk-local indices and can share names; here each chunk's own layer names its parameters.
Every rank takes part in the save and the first rank writes the metadata; ranks holding the same
name write it once. Megatron-LM's `tools/checkpoint/checkpoint_inspector.py`
reads it to convert a torch_dist checkpoint to fsdp_dtensor.

Why not megatron-core's own writer: it reads the EP rank from its global parallel state, which
roles (built from explicit process groups) do not initialise, and saves over the default group,
which spans every role. Here the names come from the role's own groups and the save is a
collective over the role's window (`intra_dist_opt`, its first rank the coordinator). Each rank
names the parameters its optimizer holds: with the distributed optimizer, those its shard
touches; the union over the role's ranks, which DCP writes, is every parameter, as in
Megatron-LM.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.\d+")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc\d\.weight)(\d+)")
_SEQUENTIAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(?=\.)")


def param_group_indices(optimizer) -> dict[torch.nn.Parameter, int]:
    """Model parameter -> index of its group in `optimizer.param_groups`, for the parameters
    this rank's optimizer holds (a ChainedOptimizer lists its optimizers' groups in turn)."""
    out: dict[torch.nn.Parameter, int] = {}
    base = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "model_param_group_index_map"):  # DistributedOptimizer: its shard's
            for param, (index, _) in opt.model_param_group_index_map.items():
                out[param] = base + index
        elif hasattr(opt, "float16_groups"):  # its groups hold fp32 copies of fp16/bf16 params
            for index, params in enumerate(zip(opt.float16_groups, opt.fp32_from_fp32_groups)):
                out.update(dict.fromkeys(params[0] + params[1], base + index))
        else:  # FP32Optimizer: its groups hold the model's own parameters
            for index, group in enumerate(opt.param_groups):
                out.update(dict.fromkeys(group["params"], base + index))
        base += len(opt.param_groups)
    return out


def global_param_names(
    model_chunks: list, num_experts: int | None, ep_group
) -> dict[torch.nn.Parameter, str]:
    """Model parameter -> its global unique name (global layer and expert indices), as
    megatron-core's `get_global_unique_param_name` names it; `ep_group`: the role's EP group.
    With several chunks (virtual pipeline stages) each chunk's own layers give the index."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer_of = {
        id(param): module.layer_number - 1
        for chunk in model_chunks
        for module in chunk.modules()
        if isinstance(module, TransformerLayer)
        for param in module.parameters()
    }
    local_experts = num_experts // dist.get_world_size(ep_group) if num_experts else 0
    first_expert = dist.get_rank(ep_group) * local_experts

    def shift(match: re.Match) -> str:
        return f"{match[1]}{int(match[2]) + first_expert}"

    out = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if id(param) in layer_of and "mtp" not in name:
                name = _LAYER.sub(f"layers.{layer_of[id(param)]}", name)
            if num_experts:
                name = _SEQUENTIAL_EXPERT.sub(shift, _GROUPED_EXPERT.sub(shift, name))
            out.setdefault(param, name)
    return out


def param_to_param_group_map(
    optimizer, model_chunks: list, num_experts: int | None, ep_group
) -> dict[str, int]:
    """This rank's part of the map: global unique name -> param group index."""
    names = global_param_names(model_chunks, num_experts, ep_group)
    return {names[p]: index for p, index in param_group_indices(optimizer).items()}


def dump_param_to_param_group_map(
    path: str, optimizer, model_chunks: list, num_experts: int | None, pgc
) -> dict[str, int]:
    """Write the map of the role's optimizer to `path` as Megatron-LM does (see the module
    doc); collective over the role's window (`pgc.intra_dist_opt`). Returns this rank's part."""
    from torch.distributed.checkpoint import save

    local = param_to_param_group_map(optimizer, model_chunks, num_experts, pgc.ep)
    save(state_dict=dict(local), checkpoint_id=path, process_group=pgc.intra_dist_opt)
    if dist.get_rank(pgc.intra_dist_opt) == 0:
        logger.info("wrote the param -> param group map of %d groups to %s",
                    len(optimizer.param_groups), path)  # fmt: skip
    return local
