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


def sync_weights(groups, roles: dict, engine, version: int) -> dict[str, float]:
    """Push the train role's weights to engines and the logp role (collective); returns metrics."""
    rank = dist.get_rank()
    start = time.perf_counter()
    hf_sd = roles["train"].gather_hf_state_dict() if "train" in roles else None
    gathered = time.perf_counter()
    if groups.weight_sync is None:
        return {"timing/weight_sync/gather_s": gathered - start}
    src = groups.weight_sync_ranks[0]
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in hf_sd.items()] if rank == src else None]
    dist.broadcast_object_list(meta, src=src, group=groups.weight_sync)
    received = {}
    for name, shape, dtype in meta[0]:
        tensor = hf_sd[name].contiguous() if rank == src else torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=src, group=groups.weight_sync)
        received[name] = tensor
    sent = time.perf_counter()
    if engine is not None:
        engine.begin_weight_update()
        try:
            engine.update_weights(
                list(received.items()), version=engine_version_label(version), flush_cache=True
            )
        finally:
            engine.end_weight_update()
    if "logp" in roles:
        role = roles["logp"]
        weights.load_hf_state_dict_into_megatron(
            role.module, received, role.args, role.pgc, role.spec
        )
    loaded = time.perf_counter()
    num_bytes = sum(t.numel() * t.element_size() for t in received.values())
    return {
        "timing/weight_sync/gather_s": gathered - start,
        "timing/weight_sync/send_s": sent - gathered,
        "timing/weight_sync/load_s": loaded - sent,
        "weight_sync/GB": num_bytes / 1e9,
    }
