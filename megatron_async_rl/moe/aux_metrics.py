"""The MoE auxiliary losses of a train step as metrics, as Megatron-LM's training loop logs them.

Owned here: which losses the routers of a role record (`tracked_names`, from its Megatron args:
each load-balancing type with a non-zero coefficient, and the z-loss), and turning megatron-core's
layer-wise tracker (0.16: `moe_utils.get_moe_layer_wise_logging_tracker`; 0.19:
`moe_logging.get_moe_metrics_tracker`; filled by the routers in training forwards) into metrics
after a step: `moe/<name>` (`actor/moe/<name>` in the train step's metrics, `critic/moe/<name>` for
a critic), the loss (without its coefficient) averaged over the step's micro-batches and
data-parallel ranks and over the MoE layers, and with --moe-per-layer-logging
`moe/<name>/layer_<i>` for each MoE layer i. The reduction is megatron-core's own
(`reduce_aux_losses_tracker_across_ranks`) over the role's groups (so the global load-balancing
loss is its data-parallel ranks' partial losses summed, as megatron-core defines it), except that a
loss without a reduce group (the z-loss, which Megatron-LM logs from one rank) is averaged over the
data-parallel ranks; names a stage's routers did not record (a stage of dense layers) are zeros
there, so every rank of the role takes part in the same collectives.
Called by `roles.megatron_role.MegatronRole.train_step`.
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
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.clear()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def _metrics_tracker():
    """megatron-core's tracker object where it has one (0.19: `moe_logging.MoEMetricsTracker`,
    whose `get_moe_layer_wise_logging_tracker` returns a fresh dict copy on each call, so
    writing into that dict changes nothing); None on 0.16, where that dict is the tracker."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return None
    return get_moe_metrics_tracker()


def step_metrics(
    names: list[str], moe_layers: list[int], num_layers: int, num_micro: int, pg_collection,
    device, per_layer: bool,
) -> dict[str, float]:  # fmt: skip
    """The step's `moe/*` metrics (module docstring); collective over the role's ranks. The
    tracker is cleared afterwards."""
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    # megatron-core's reduction takes the pipeline group and a data-parallel group from the
    # collection it is given: `dp` on 0.16, `dp_cp_gtp_remat` on 0.19 (a role's collection has no
    # such group, and megatron-core then reads its global parallel state, which a role never
    # initialises). Both name the role's data-parallel group here, megatron-core's own fallback.
    groups = SimpleNamespace(pp=pg_collection.pp, dp=pg_collection.dp,
                             dp_cp_gtp_remat=pg_collection.dp)  # fmt: skip
    tracker = _metrics_tracker()
    if tracker is not None:
        entries = {}
        for name in names:
            tracker.ensure_initialized(name, num_layers, device=device)
            entries[name] = tracker.metrics[name]
        for entry in entries.values():  # 0.19's z-loss comes with an avg group of its own
            if entry.reduce_group is None and entry.avg_group is None:
                entry.avg_group = pg_collection.dp
        reduce_aux_losses_tracker_across_ranks(names, pg_collection=groups)
        # a copy: clear() zeroes the tracked tensors in place
        values = {name: entry.values.float().cpu().clone() for name, entry in entries.items()}
        tracker.clear()
    else:
        legacy = get_moe_layer_wise_logging_tracker()
        for name in names:
            legacy.setdefault(name, {
                "values": torch.zeros(num_layers, device=device), "reduce_group": None,
                "avg_group": None, "reduce_group_has_dp": False,
            })  # fmt: skip
        for name in names:  # the z-loss has no reduce group: Megatron-LM logs one rank's value
            if legacy[name].get("reduce_group") is None and legacy[name].get("avg_group") is None:
                legacy[name]["avg_group"] = pg_collection.dp  # here the data-parallel mean
        reduce_aux_losses_tracker_across_ranks(names, pg_collection=groups)
        values = {name: legacy[name]["values"].float().cpu() for name in names}
        legacy.clear()
    out = {}
    for name in names:
        layer_values = values[name] / num_micro
        out[f"moe/{name}"] = float(layer_values[moe_layers].sum()) / len(moe_layers)
        if per_layer:
            for layer in moe_layers:
                out[f"moe/{name}/layer_{layer}"] = float(layer_values[layer])
    return out
