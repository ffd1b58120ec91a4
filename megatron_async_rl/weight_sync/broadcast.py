"""Weight sync, first version: gather the train role's model, broadcast it, load it everywhere.

Owned here: moving the train role's new weights (version v) into every `generate` rank's engine
and into the `logp` role's model after each optimizer step. Called by the jobs on every rank
(collective over the train role and the `weight_sync` group).

Order: (1) gather the whole model in HF names on the train role's first rank (TP/EP all-gather,
then PP/EP parts to that rank: `models.weights`); (2) broadcast names/shapes/dtypes, then each
tensor, over the gloo `weight_sync` group; (3) generate ranks load them through SGLang's own
`update_weights_from_tensor` between begin/end and stamp version `v<k>`; logp ranks copy their
shard. The planned, bucketed, overlapped and memory-bounded version replaces steps 1-3 later
behind the same call; its bound does not apply here (the train rank holds the whole model).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_async_rl.models import weights

logger = logging.getLogger(__name__)


def engine_version_label(version: int) -> str:
    return f"v{version}"


def broadcast_weights(groups, roles: dict) -> tuple[dict | None, dict[str, float]]:
    """Gather on the train role and broadcast to the `weight_sync` group (collective).

    Returns the HF-named tensors on every `weight_sync` member (None elsewhere) and timings.
    An asynchronous generate rank calls it from its weight-receiver thread with no roles.
    """
    start = time.perf_counter()
    hf_sd = roles["train"].gather_hf_state_dict() if "train" in roles else None
    gathered = time.perf_counter()
    timings = {"timing/weight_sync/gather_s": gathered - start}
    if groups.weight_sync is None:
        return None, timings
    src = groups.weight_sync_ranks[0]
    rank = dist.get_rank()
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in hf_sd.items()] if rank == src else None]
    dist.broadcast_object_list(meta, src=src, group=groups.weight_sync)
    received = {}
    for name, shape, dtype in meta[0]:
        tensor = hf_sd[name].contiguous() if rank == src else torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=src, group=groups.weight_sync)
        received[name] = tensor
    timings["timing/weight_sync/send_s"] = time.perf_counter() - gathered
    num_bytes = sum(t.numel() * t.element_size() for t in received.values())
    timings["weight_sync/GB"] = num_bytes / 1e9
    return received, timings


def load_into_engine(engine, tensors: dict, version: int, in_place: bool = False) -> None:
    """Load HF-named tensors into an engine and stamp `v<version>`.

    `in_place`: the engine keeps generating around the load (pause in place -> load ->
    continue); its prefix cache is not flushed here (SGLang cannot flush with requests held),
    so the caller flushes it once the engine is idle.
    """
    if in_place:
        engine.pause("in_place")
    engine.begin_weight_update()
    try:
        engine.update_weights(
            list(tensors.items()), version=engine_version_label(version), flush_cache=not in_place
        )
    finally:
        engine.end_weight_update()
        if in_place:
            engine.resume()


def sync_weights(groups, roles: dict, engine, version: int) -> dict[str, float]:
    """Push the train role's weights to engines and the logp role (collective); returns metrics."""
    received, metrics = broadcast_weights(groups, roles)
    if received is None:
        return metrics
    start = time.perf_counter()
    if engine is not None:
        load_into_engine(engine, received, version)
    if "logp" in roles:
        role = roles["logp"]
        weights.load_hf_state_dict_into_megatron(
            role.module, received, role.args, role.pgc, role.spec
        )
    metrics["timing/weight_sync/load_s"] = time.perf_counter() - start
    return metrics
