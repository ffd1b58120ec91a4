"""The MoE auxiliary losses of a train step as metrics, as Megatron-LM's training loop logs them.

Owned here: which losses the routers of a role record (`tracked_names`, from its Megatron args:
each load-balancing type with a non-zero coefficient, and the z-loss), and turning megatron-core's
layer-wise tracker (`moe_utils.get_moe_layer_wise_logging_tracker`, filled by the routers in
training forwards) into metrics after a step: `moe/<name>` (`actor/moe/<name>` in the train
step's metrics, `critic/moe/<name>` for a critic), the loss (without its coefficient)
averaged over the step's micro-batches and data-parallel ranks and over the MoE layers, and with
--moe-per-layer-logging `moe/<name>/layer_<i>` for each MoE layer i. The reduction is
megatron-core's own (`reduce_aux_losses_tracker_across_ranks`) over the role's groups (so the
global load-balancing loss is its data-parallel ranks' partial losses summed, as megatron-core
defines it), except that a loss without a reduce group (the z-loss, which Megatron-LM logs from
one rank) is averaged over the data-parallel ranks; names a
stage's routers did not record (a stage of dense layers) are zeros there, so every rank of the
role takes part in the same collectives. Called by `roles.megatron_role.MegatronRole.train_step`.
"""

from __future__ import annotations

from typing import Any

_LOAD_BALANCING = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
"""--moe-router-load-balancing-type -> the name megatron-core's routers record it under."""


def tracked_names(args: dict[str, Any]) -> list[str]:
    """The losses the routers of a role with `args` record, in a fixed order."""
    if not args.get("num_experts"):
        return []
    types = args.get("moe_router_load_balancing_type") or "aux_loss"
    types = list(types) if isinstance(types, (list, tuple)) else [types]
    coeffs = args.get("moe_aux_loss_coeff") or 0.0
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    names = [_LOAD_BALANCING[t] for t, c in zip(types, coeffs) if t in _LOAD_BALANCING and c]
    if args.get("moe_z_loss_coeff"):
        names.append("z_loss")
    return names


def clear() -> None:
    """Forget what the routers recorded (before a step: only its own training forwards count)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def step_metrics(
    names: list[str], moe_layers: list[int], num_layers: int, num_micro: int, pg_collection,
    device, per_layer: bool,
) -> dict[str, float]:  # fmt: skip
    """The step's `moe/*` metrics (module docstring); collective over the role's ranks. The
    tracker is cleared afterwards."""
    import torch
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:
        tracker.setdefault(name, {
            "values": torch.zeros(num_layers, device=device), "reduce_group": None,
            "avg_group": None, "reduce_group_has_dp": False,
        })  # fmt: skip
    for name in names:  # the z-loss has no reduce group: Megatron-LM logs one rank's value
        if tracker[name].get("reduce_group") is None and tracker[name].get("avg_group") is None:
            tracker[name]["avg_group"] = pg_collection.dp  # here the data-parallel mean
    reduce_aux_losses_tracker_across_ranks(names, pg_collection=pg_collection)
    out = {}
    for name in names:
        values = tracker[name]["values"].float().cpu() / num_micro
        out[f"moe/{name}"] = float(values[moe_layers].sum()) / len(moe_layers)
        if per_layer:
            for layer in moe_layers:
                out[f"moe/{name}/layer_{layer}"] = float(values[layer])
    tracker.clear()
    return out
