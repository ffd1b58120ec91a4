"""The recipe's `weight_sync:` section: bucket sizes, transport and retries of the reshard.

Owned here: `WeightSyncConfig`, validated where it is built. Read by `weight_sync.broadcast`
(`sync_weights(..., config=cfg.weight_sync)`), which turns the sizes into a `plan.build_plan`.
Torch-free, like the rest of the config (the recipe loader imports it).

Memory bound, per sync: a sender holds at most 2 produce buffers (gathering one bucket while the
previous one is on the wire), a streaming receiver at most 2 consume buffers (receiving one
message while the previous one loads; none with the shared-memory transport, where it reads
the sender's buffers in place); plus the HF tensors of the parameter a sender is packing and,
on a receiver, one tensor larger than a message per sender (staged whole until its last piece
arrives: engines load whole tensors). The buffers are kept from one sync to the next by the
job (`buffers.BufferPool`), so the bound is also what a rank holds between syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import require_choice, require_int, require_number
from megatron_async_rl.config.errors import ConfigError

MIB = 1 << 20
TRANSPORTS = ("auto", "broadcast")
BRIDGES = ("auto", "host", "device")


@dataclass
class WeightSyncConfig:
    """How the train role's weights are cut, sent and loaded after each optimizer step."""

    produce_bucket_mb: float = 512
    """MiB one sender gathers and packs at a time (its TP/EP shards assembled into HF tensors);
    a sender holds two such buffers. Larger: fewer rounds; smaller: less sender memory."""
    consume_bucket_mb: float = 128
    """MiB one message carries: the unit of sending, checksum and engine load. A receiver holds
    two such buffers; a tensor larger than this is sent in pieces and staged whole once."""
    transport: str = "auto"
    """How a sender's messages reach its receivers. "auto": when every receiver runs on the
    sender's host and can map its memory, the sender packs into shared memory that receivers
    (and their engines) read in place, and only a 32-byte header per message goes over the
    group (the CPU counterpart of CUDA IPC for co-located ranks); otherwise, and with
    "broadcast", each message is broadcast whole over the sender's gloo group."""
    bridge: str = "auto"
    """Where messages lie between the train role and the receivers. "device": on the train
    role's device, over the platform's collective backend (NCCL between GPUs: buffers, the
    checksum and the hand-over to an engine stay on the GPU, which SGLang receives as CUDA IPC
    handles; gloo and CPU buffers on CPU). "host": in host memory over gloo (senders copy their
    GPU tensors out; `transport` applies). "auto": "device" when the train role runs on CUDA,
    the world's backend is NCCL and engines have `engine.tp_size` 1, else "host" ("device"
    with engines of TP > 1 is refused: each TP rank would map its host's GPU over CUDA IPC).
    On CPU both are the host bridge."""
    max_attempts: int = 2
    """Times one version is sent before the sync fails: a message that fails its checksum, or
    that an engine rejects, on any receiver makes every participant run the reshard again from
    the start (the trainer's weights have not moved). 1: no second attempt."""
    delta: bool = False
    """Send, between hosts (and with `transport: broadcast`), only what changed: each message as
    a delta against the version every receiver of its sender holds (`weight_sync.delta`: the
    changed elements at the engine's dtype, sparse and zstd-compressed, or the message whole
    where that is smaller), decoded by each receiver and checked as a whole message is. Costs
    memory: a sender keeps its messages (its share of the model at the engine's dtype), a
    receiver the messages of the senders it gets deltas from (the model at the engine's dtype).
    A failed or first sync, a new or restarted rank and every `full_every`-th version send
    whole messages. Not on the device bridge (NCCL) or the shared-memory transport (nothing is
    copied there)."""
    full_every: int = 20
    """With `delta`: every this many versions, a sender sends its messages whole (1: always)."""
    on_failure: str = "keep_serving"
    """After the last attempt failed. "keep_serving": when every failing receiver is an engine
    that can keep (or get back) the last complete version, the version is skipped there (the
    engine serves the last good one; torn by a partial load, it reloads it) and the run goes on
    (`weight_sync/failed_versions`); a failure anywhere else (the logp role) still stops it.
    "stop": any failure stops the run."""

    def __post_init__(self) -> None:
        for name in ("produce_bucket_mb", "consume_bucket_mb"):
            value = getattr(self, name)
            if require_number(name, value, gt=0, unit="MiB") * MIB < 4096:
                raise ConfigError(name, value, "must be at least 4 KiB (0.004 MiB)")
        require_choice("transport", self.transport, TRANSPORTS)
        require_choice("bridge", self.bridge, BRIDGES)
        require_int("max_attempts", self.max_attempts, 1)
        require_choice("on_failure", self.on_failure, ("keep_serving", "stop"))
        if not isinstance(self.delta, bool):
            raise ConfigError("delta", self.delta, "must be true or false")
        require_int("full_every", self.full_every, 1)

    @property
    def produce_bytes(self) -> int:
        return int(self.produce_bucket_mb * MIB)

    @property
    def consume_bytes(self) -> int:
        return int(self.consume_bucket_mb * MIB)
