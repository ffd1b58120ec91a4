"""Weight sync, the public entry points: train role -> generate engines and the logp role.

Owned here: `sync_weights` (one collective call per optimizer step), `broadcast_weights` (the
receive-into-host-staging variant for an asynchronous generate rank's weight thread),
`warm_up` (the start-up reshard that loads nothing: communicators and buffers before engines)
and `load_into_engine` (re-exported from `sinks`). Called by the jobs on every rank; the work is
done by `plan` (what moves where), `executor` (gather, send, receive, verify) and `sinks`.

Per call, on every participant:
1. the plan key (train grid, model dims, dtype, bucket sizes, version) goes from the first
   sender to the receivers over that sender's group; train ranks compute it themselves, and
   every rank builds the same cached `ReshardPlan`; every participant (`groups.weight_sync`)
   learns whether any cannot take part (a parameter the plan cannot map, a version mismatch):
   then all raise, before anything is sent;
2. `executor.run_plan`: each PP stage / EP rank's sender gathers its buckets from its TP and
   expert-TP members and streams them to every receiver over its own group: gloo and host
   memory (the host bridge), or NCCL and GPU memory (the device bridge, `PlanKey.device_type`,
   chosen by the train ranks from `WeightSyncConfig.bridge` and told to the receivers);
3. a generate rank streams each checked message into its engine (`EngineSink`, SGLang's own
   `update_weights_from_tensor` between begin/end, version stamped by the last call); a logp
   rank copies the pieces its parameters come from straight into them (`ShardSink`: its
   slices only, where the messages arrive); a rank with both, or an asynchronous generate
   rank's weight thread, stages the whole model first (`StagingSink`);
4. every participant learns every receiver's outcome: after a checksum mismatch or a rejected
   load anywhere, all run steps 1-3 again (`WeightSyncConfig.max_attempts`), then all raise the
   same error, unless only engines that can keep their last complete version failed and
   `on_failure` is `keep_serving`: then all skip the version (`weight_sync/failed_versions`)
   and a torn engine reloads its last version. An engine left with partly new weights refuses
   to generate until an update completes (`engines.protocol.WeightSessions`).

Metrics (this rank's): `timing/weight_sync/{gather,send,load}_s`, `weight_sync/GB` (the plan's
bytes), `weight_sync/GB_per_s` (over this rank's wall time) and peak buffer sizes
`weight_sync/{produce,consume,gathered,staging}_peak_MB`; with a `buffers.BufferPool`, the bytes
it keeps between syncs, `weight_sync/pool_MB`; `weight_sync/attempts`, `.../failed_versions`;
`weight_sync/shared_memory_senders` (senders this rank dealt with over shared memory);
`weight_sync/device_bridge` (1 when messages stayed on the GPU). With `weight_sync.delta`
(messages through the delta codec, `delta_wire`): `weight_sync/delta_fraction` (bytes on the
wire / bytes of the whole messages), `weight_sync/delta_senders` and `weight_sync/full_syncs`
(senders of this rank's groups that sent deltas, or sent whole while keeping bases),
`weight_sync/delta_fallbacks` (deltas that did not decode, or decoded to bytes that failed
their checksum, on any participant and over the attempts of the version: it is sent again,
whole), `timing/weight_sync/{encode,decode}_s`, and
the bases held, `weight_sync/delta_base_peak_MB`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from megatron_async_rl.distributed import devices
from megatron_async_rl.distributed.layout import RoleGrid
from megatron_async_rl.models import weights
from megatron_async_rl.models.dims import ModelDims, expert_offset
from megatron_async_rl.weight_sync import buffers, executor, plan
from megatron_async_rl.weight_sync.config import WeightSyncConfig
from megatron_async_rl.weight_sync.delta_wire import DeltaBases
from megatron_async_rl.weight_sync.shard_sink import ShardSink
from megatron_async_rl.weight_sync.sinks import (  # noqa: F401 - public API, re-exported
    EngineSink,
    StagedWeights,
    StagingSink,
    WarmSink,
    engine_version_label,
    load_into_engine,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """Everything `plan.build_plan` needs, plus the version being sent."""

    layout: RoleGrid
    dims: ModelDims
    dtype: str
    produce_bytes: int
    consume_bytes: int
    version: int
    device_type: str = "cpu"
    """Where messages lie between senders and receivers: "cpu" (the host bridge, and the
    device bridge on CPU) or "cuda" (the device bridge over NCCL)."""


def _bridge_device(bridge: str, backend: str, on_cuda: bool, engine_tp: int = 1) -> str:
    """The bridge's device type, from `WeightSyncConfig.bridge`, the world's backend, where
    the train role's weights are ("device" on CUDA over a gloo world: GPU slots over gloo's
    CUDA path) and the engines' TP size: "auto" keeps engines of TP > 1 on the host bridge
    (review finding 8: each TP rank would map the host GPU's buffer over CUDA IPC, a second
    CUDA context on that GPU and peer copies; from host memory each copies to its own GPU).
    The recipe refuses "device" with such engines."""
    if bridge == "host" or not on_cuda:
        return "cpu"
    if bridge == "auto" and (backend != "nccl" or engine_tp > 1):
        return "cpu"
    return "cuda"


def _train_key(groups, role, version: int, config: WeightSyncConfig) -> PlanKey:
    layout = groups.layout.grid("train")
    # No MTP layers (--mtp-num-layers): the engines run no speculative decoding, and their
    # causal LM has no names for DeepSeek-V3's (model.layers.{num_layers + i})
    dims = weights.model_dims(role.args, role.spec, mtp=False)
    param = next(role.chunks[0].parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    engine_tp = groups.layout.engine_tp_size
    device = _bridge_device(config.bridge, groups.backend, param.is_cuda, engine_tp)
    return PlanKey(layout, dims, dtype, config.produce_bytes, config.consume_bytes, version, device)


def _local_state(role, reshard: plan.ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    # every model chunk's, `chunk_name`d, MTP layers left out (`_train_key`); whole tensors
    # under FSDP2 (every train rank is here)
    local = weights.full_rank_state_dict(role.chunks, mtp_num_layers=0)
    dims, pgc = reshard.dims, role.pgc
    e0 = 0
    if dims.num_experts:
        e0 = expert_offset(
            dist.get_rank(pgc.ep), dist.get_world_size(pgc.ep), dims.num_experts
        )
    plan.check_stage_names(reshard, rank, list(local), dist.get_rank(pgc.pp), e0)
    return local


def _metrics(stats: executor.SyncStats, reshard: plan.ReshardPlan) -> dict[str, float]:
    gb = reshard.nbytes / 1e9
    out = {
        "timing/weight_sync/gather_s": stats.gather_s,
        "timing/weight_sync/send_s": stats.send_s,
        "timing/weight_sync/load_s": stats.load_s,
        "weight_sync/GB": gb,
        "weight_sync/GB_per_s": gb / stats.wall_s if stats.wall_s > 0 else 0.0,
        "weight_sync/shared_memory_senders": float(stats.shared_memory_senders),
    }
    if stats.full_bytes:  # messages through the delta codec
        out.update({
            "weight_sync/delta_fraction": stats.wire_bytes / stats.full_bytes,
            "weight_sync/delta_senders": float(stats.delta_senders),
            "weight_sync/full_syncs": float(stats.full_senders),
            "weight_sync/delta_fallbacks": float(stats.delta_failures),
            "timing/weight_sync/encode_s": stats.encode_s,
            "timing/weight_sync/decode_s": stats.decode_s,
        })  # fmt: skip
    for kind, peak in stats.counter.peak.items():
        out[f"weight_sync/{kind}_peak_MB"] = peak / 2**20
    return out


def _agree(
    groups, error: str | None, recoverable: bool = False, fallbacks: int = 0
) -> tuple[list[str], bool, int]:
    """Every participant's error of this attempt, "global rank r: ...", whether every
    participant that failed can recover from it (`WeightSyncConfig.on_failure`), and the deltas
    that failed on all of them (`fallbacks`: this rank's) (collective).

    The ranks first add up (failed, fallbacks) in one `all_reduce`; only when one failed do
    they gather each other's errors (an object gather is 2 collectives and pickling, about 1 ms
    more between two processes on 2 cores, twice in every sync)."""
    counts = torch.tensor([error is not None, fallbacks], dtype=torch.int64)
    dist.all_reduce(counts, group=groups.weight_sync)
    if not counts[0]:
        return [], True, int(counts[1])
    box: list = [None] * dist.get_world_size(groups.weight_sync)
    devices.all_gather_object(box, (groups.rank, error, recoverable, fallbacks),
                              group=groups.weight_sync)  # fmt: skip
    errors = [f"global rank {r}: {e}" for r, e, _, _ in box if e]
    return errors, all(ok for _, e, ok, _ in box if e), sum(n for *_, n in box)


def _attempt(groups, train, receiving: bool, version, config, make_sink, pool, device,
             tamper=None, roles=None):  # fmt: skip
    """One run of the reshard: (sink, metrics, errors of every participant, retryable, and
    whether every failing participant could keep serving its last version)."""
    rank = groups.rank
    key = _train_key(groups, train, version, config) if train else None
    first = min(groups.weight_senders)
    if groups.weight_senders[first] is not None:
        box = [key]
        devices.broadcast_object_list(box, src=first, group=groups.weight_senders[first])
        key = box[0]
    error = None
    if version is not None and key.version != version:
        error = f"expects version {version} but sender global rank {first} sends {key.version}"
    if key.device_type != "cuda":
        device = torch.device("cpu")
    elif (device is None or device.type != "cuda") and error is None:
        error = (
            "weight_sync.bridge: the train role sends over the device bridge (its weights "
            "are on CUDA) but this receiver has no CUDA device; set weight_sync.bridge=host"
        )
    reshard = plan.build_plan(key.layout, key.dims, key.dtype, key.produce_bytes, key.consume_bytes)
    local = tp_groups = None
    if train is not None and error is None:
        try:
            local = _local_state(train, reshard, rank)
        except ValueError as exc:  # a parameter the plan cannot map, or lacks
            error = str(exc)
        tp_groups = {"tp": train.pgc.tp, "expt_tp": train.pgc.expt_tp}
    counter = buffers.MemoryCounter()
    sink = None
    if receiving and error is None:
        try:
            sink = make_sink(reshard, key, counter)
        except ValueError as exc:  # a receiving model the plan does not fit
            error = str(exc)
    errors, _, _ = _agree(groups, error)  # before anything moves: nothing to undo
    if errors:
        return None, {}, errors, False, False
    if hasattr(sink, "begin"):
        sink.begin()
    stats = None
    finished = None
    bases = _delta_bases(pool, config)
    try:
        stats = executor.run_plan(
            reshard, rank, key.version, groups.weight_sender_groups(device.type != "cpu"),
            local=local, tp_groups=tp_groups,
            sink=sink, counter=counter, pool=pool, transport=config.transport, device=device,
            tamper=tamper, bases=bases,
        )  # fmt: skip
    finally:
        if hasattr(sink, "finish"):  # may name what a complete run left undone
            finished = sink.finish(complete=stats is not None and stats.error is None)
    error = str(stats.error) if stats.error is not None else finished
    if error and bases is not None:
        bases.drop()  # what this rank kept is not what it loaded: the next sync is whole
    recoverable = bool(getattr(sink, "recoverable", False)) and "logp" not in (roles or {})
    errors, recoverable, fallbacks = _agree(groups, error, recoverable, stats.delta_failures)
    metrics = _metrics(stats, reshard)
    if bases is not None:  # every participant's, the same on all of them
        metrics["weight_sync/delta_fallbacks"] = float(fallbacks)
    metrics["weight_sync/device_bridge"] = float(device.type != "cpu")
    if pool is not None:
        metrics["weight_sync/pool_MB"] = pool.held_bytes / 2**20
    return sink, metrics, errors, True, recoverable


def _delta_bases(pool, config: WeightSyncConfig) -> DeltaBases | None:
    """This rank's delta bases, kept in `pool` from one sync to the next (`config.delta`;
    without a pool, every sync is whole)."""
    if not config.delta or pool is None:
        return None
    if pool.delta_bases is None or pool.delta_bases.full_every != config.full_every:
        pool.delta_bases = DeltaBases(config.full_every)
    return pool.delta_bases


def _reshard(groups, roles: dict, version: int | None, config, make_sink, pool, device,
             tamper=None):  # fmt: skip
    """Take part in one reshard; returns (sink or None, metrics). Collective.

    Every participant (train ranks and receivers, `groups.weight_sync`) learns every other's
    outcome: a receiver's checksum or load failure makes all of them run the reshard again (up
    to `config.max_attempts` in all), then raise the same error naming every failing rank; a
    plan or version mismatch raises at once, before anything is sent.
    """
    rank, train = groups.rank, roles.get("train")
    receiving = rank in groups.weight_receivers
    if not groups.weight_senders or (train is None and not receiving):
        return None, {}
    config = config or WeightSyncConfig()
    fallbacks = 0.0  # deltas that failed, over the attempts of this version
    for attempt in range(1, config.max_attempts + 1):
        sink, metrics, errors, retryable, recoverable = _attempt(
            groups, train, receiving, version, config, make_sink, pool, device, tamper, roles
        )
        if "weight_sync/delta_fallbacks" in metrics:
            fallbacks += metrics["weight_sync/delta_fallbacks"]
            metrics["weight_sync/delta_fallbacks"] = fallbacks
        if not errors:
            metrics["weight_sync/attempts"] = attempt
            return sink, metrics
        last = attempt == config.max_attempts
        if retryable and last and recoverable and config.on_failure == "keep_serving":
            logger.error(
                "weight sync v%s: failed after %d attempt(s) on %d engine(s), which keep "
                "serving their last complete version; the run goes on: %s",
                version, attempt, len(errors), " | ".join(errors),
            )  # fmt: skip
            metrics.update({"weight_sync/attempts": attempt, "weight_sync/failed_versions": 1.0})
            return None, metrics  # nothing of the version is handed on
        if not retryable or last:
            raise RuntimeError(
                f"weight sync v{version}: failed after {attempt} attempt(s) (max_attempts "
                f"{config.max_attempts}) on {len(errors)} rank(s): " + " | ".join(errors)
            )
        logger.warning(
            "weight sync v%s: attempt %d of %d failed on %d rank(s), sending it again: %s",
            version, attempt, config.max_attempts, len(errors), " | ".join(errors),
        )  # fmt: skip
    raise AssertionError("unreachable")


def broadcast_weights(
    groups,
    roles: dict,
    config: WeightSyncConfig | None = None,
    version: int | None = None,
    pool: buffers.BufferPool | None = None,
    device: torch.device | None = None,
    tamper=None,
) -> tuple[StagedWeights | None, dict[str, float]]:
    """Reshard with receivers staging whole tensors in host memory (collective).

    Returns the `StagedWeights` on receivers (None elsewhere) and this rank's metrics. An
    asynchronous generate rank calls it from its weight thread with no roles (generation keeps
    running), then pauses, `load_into_engine`s the result in consume chunks and resumes.
    `pool`: buffers kept from one call to the next (the staging arena among them: the result
    is valid until the next call with the same pool). `device`: the rank's device
    (`Platform.device()`, passed in: never the calling thread's current CUDA device), where
    device-bridge buffers go; None: this rank has none but the CPU. `tamper`: fault injection
    on received messages (`executor.run_plan`).
    """

    def staging(reshard, key, counter) -> StagingSink:
        pinned = key.device_type == "cuda"
        return StagingSink(reshard, counter, key.version, key.consume_bytes, pool, pinned)

    sink, metrics = _reshard(groups, roles, version, config, staging, pool, device, tamper)
    return (sink.weights if sink is not None else None), metrics


def warm_up(
    groups,
    roles: dict,
    config: WeightSyncConfig | None = None,
    pool: buffers.BufferPool | None = None,
    device: torch.device | None = None,
    streaming: bool = False,
    staging: bool = False,
) -> dict[str, float]:
    """One reshard of the initial weights (version 0) that loads nothing (collective), run at
    start-up before any engine starts. Review finding 8: the device bridge's NCCL
    communicators and every buffer the rank's syncs keep in `pool` (slots, split staging and,
    with `staging`, an asynchronous engine host's whole-model arena) then exist before SGLang
    sizes its static memory pool from the GPU memory left free; and a plan that does not fit
    the receivers fails before any engine starts. `streaming`: this receiver will load each
    message into its engine (its buffers are shared, as `EngineSink`'s); `device`: as
    `broadcast_weights`."""

    def warm(reshard, key, counter) -> WarmSink:
        pinned = key.device_type == "cuda"
        return WarmSink(reshard, counter, pool, streaming, staging, pinned)

    return _reshard(groups, roles, 0, config, warm, pool, device)[1]


def sync_weights(
    groups,
    roles: dict,
    engine,
    version: int,
    config: WeightSyncConfig | None = None,
    pool: buffers.BufferPool | None = None,
    device: torch.device | None = None,
    tamper=None,
) -> dict[str, float]:
    """Push the train role's weights to engines and the logp role (collective); returns metrics.

    A generate rank with an engine (and no logp role) streams into it within the consume bound;
    other receivers stage the whole model first. `pool`: this rank's buffers, kept from one
    sync to the next (a job passes the same one every step); `device`: as `broadcast_weights`.
    Raises RuntimeError, on every participant, naming parameters, sender and receiver ranks and
    the version on a checksum mismatch or a chunk the engine rejects that persists over
    `config.max_attempts` (unless `config.on_failure` lets engines keep serving). `tamper`:
    fault injection on received messages (`run_plan`).
    """
    if engine is not None and "logp" not in roles:

        def streaming(reshard, key, counter):
            dtype = buffers.torch_dtype(reshard.dtype)
            return EngineSink(engine, key.version, groups.rank, counter, dtype, pool=pool)

        metrics = _reshard(groups, roles, version, config, streaming, pool, device, tamper)[1]
        if metrics.get("weight_sync/failed_versions"):  # torn by a partial load: undo it
            engine.restore_last_version()
        return metrics
    if engine is None and "logp" in roles:
        role = roles["logp"]

        def into_shards(reshard, key, counter):
            dims = weights.model_dims(role.args, role.spec, mtp=False)
            ranks = weights.stage_ranks(role.pgc)
            dtype = buffers.torch_dtype(reshard.dtype)
            return ShardSink(role.chunks, dims, ranks, counter, dtype, groups.rank)

        return _reshard(groups, roles, version, config, into_shards, pool, device, tamper)[1]
    staged, metrics = broadcast_weights(groups, roles, config, version, pool, device, tamper)
    if staged is None:
        return metrics
    start = metrics.get("timing/weight_sync/load_s", 0.0)
    begin = time.perf_counter()
    if engine is not None:
        load_into_engine(engine, staged, version)
    if "logp" in roles:
        role = roles["logp"]
        weights.load_hf_state_dict_into_megatron(
            role.chunks, staged, role.args, role.pgc, role.spec
        )
    metrics["timing/weight_sync/load_s"] = start + time.perf_counter() - begin
    return metrics
