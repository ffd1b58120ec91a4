"""Runs a `ReshardPlan` on one rank: gather, pack, send; receive, verify, hand to a sink.

Owned here: `run_plan`, the loop that every rank taking part in a sync runs over the plan's one
global schedule, and its timings and memory peaks (`SyncStats`). Called by
`weight_sync.broadcast` on train ranks (senders, and the TP / expert-TP members holding their
shards) and on receivers (generate and logp ranks); a rank may be any mix of these.

    sender s:    gather+convert+pack message j       | messages < j on the wire (async broadcast
                 (TP/expert-TP gather, blocking)     |   on s's own gloo group {s} + receivers)
    receiver r:  message k arriving (async)          | message k-1 checked, then loaded (sink)

Double buffers: a sender packs bucket i into produce slot i % 2 once the sends of bucket i-2
from that slot have completed, and posts each message's send as soon as it is packed; a
receiver posts message k into consume slot k % 2 once message k-2 was loaded. Peak extra
memory: 2 x the largest bucket (<= produce bytes) on a sender, 2 x the largest message
(<= consume bytes) on a receiver, plus the HF tensors of the parameters a sender is packing
("gathered") and, on a receiver, one staged copy of a tensor split over messages per sender,
until its last piece arrives ("staging"); all four are counted in `SyncStats.counter`.

Transports (`weight_sync.transports`), agreed per sender at the start of each sync
(`weight_sync.negotiate`, over the sender's group): shared memory when every receiver runs on
the sender's host and can map its produce slots (only each message's header crosses; no byte
is copied between pack and load), else the collective transport, each message broadcast on the
group (whole, or, with delta bases, `weight_sync.delta`, through the delta codec
`weight_sync.delta_wire.DeltaCodec`: deltas against the version every member holds, decoded
into the receiver's consume slot and checked there as a whole message is). On the device
bridge (`WeightSyncConfig.bridge`: GPU slots, NCCL groups) nothing is negotiated: messages are
broadcast whole, and engines get CUDA views (`engines.sglang.handover`: CUDA IPC).

Ordering contract (why nothing deadlocks): every rank walks `plan.schedule` in the same order
and posts, in that order, only the operations it takes part in; it only ever waits for an
operation it posted earlier (the shared-memory transport's acknowledgements keep that order
too: `transports.shared_memory`). A receiver checks each message (version, sender, sequence
number, checksum) before its sink sees it; after the first failure it keeps receiving (so that
no sender waits forever) but loads nothing more, and reports the failure at the end
(`SyncStats.error`). Every collective names `group=`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_async_rl.models.names import hf_names_for, megatron_param_to_hf
from megatron_async_rl.models.shards import unshard
from megatron_async_rl.weight_sync import buffers
from megatron_async_rl.weight_sync.delta_wire import DeltaBases, DeltaCodec
from megatron_async_rl.weight_sync.negotiate import negotiate
from megatron_async_rl.weight_sync.plan import Message, Piece, ReshardPlan
from megatron_async_rl.weight_sync.transports.collective import CollectiveReceive, CollectiveSend
from megatron_async_rl.weight_sync.transports.shared_memory import (
    SharedMemoryReceive,
    SharedMemorySend,
)

logger = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a receiver's verified messages go (an engine, or host staging).

    A sink whose `borrows_buffers` is true hands the views it gets to other processes (an
    engine's): its receive slots are allocated in shared memory, so that they cross as a
    handle, not a copy, and it gets its own rank's messages copied there.
    """

    def add(
        self,
        message: Message,
        pieces: list[tuple[Piece, torch.Tensor]],
        sender: int,
        seq: int,
        last: bool,
    ) -> None: ...


@dataclasses.dataclass
class SyncStats:
    gather_s: float = 0.0
    """Gathering shards, converting to HF tensors and packing them (senders, TP members)."""
    send_s: float = 0.0
    """Waiting for sends to complete and for messages to arrive."""
    load_s: float = 0.0
    """In the sink: loading into the engine, or copying into host staging."""
    wall_s: float = 0.0
    counter: buffers.MemoryCounter = dataclasses.field(default_factory=buffers.MemoryCounter)
    error: Exception | None = None
    """A receiver's first check or sink error (the schedule still ran to its end)."""
    shared_memory_senders: int = 0
    """Senders of this rank's groups whose receivers read their slots in shared memory."""
    delta_senders: int = 0
    """Senders of this rank's groups that sent deltas against the version every member held."""
    full_senders: int = 0
    """Senders of this rank's groups that keep delta bases but sent this version whole."""
    wire_bytes: int = 0
    """Bytes put on (sender) or taken off (receiver) the wire through the delta codec."""
    full_bytes: int = 0
    """The whole messages those bytes stand for."""
    encode_s: float = 0.0
    decode_s: float = 0.0
    delta_failures: int = 0
    """Delta messages that did not decode, or decoded to bytes that failed their checksum."""


class _Receiver:
    """A receiver's checks and its sink; its transports (`weight_sync.transports`): the
    collective one for every sender that broadcasts to it, shared memory for those whose slots
    it mapped; the delta codecs of the senders whose messages come encoded."""

    def __init__(self, plan, rank, version, sink, stats, slot_bytes, num_messages, pool, device):
        self.plan, self.rank, self.version, self.sink, self.stats = plan, rank, version, sink, stats
        self.dtype = buffers.torch_dtype(plan.dtype)
        self.shared = getattr(sink, "borrows_buffers", True)
        self.remaining = num_messages
        self.error: Exception | None = None
        self.collective = CollectiveReceive(pool, slot_bytes, self.shared, device, stats,
                                            self.deliver)  # fmt: skip
        self.shared_memory = SharedMemoryReceive(pool, stats, self.deliver, version, rank)
        self.codecs: dict[int, DeltaCodec] = {}
        """Senders whose messages come through the delta codec (`negotiate`)."""
        self.tamper = None
        """`run_plan`'s fault injection hook, if any."""

    def use_codec(self, codec: DeltaCodec) -> None:
        self.codecs[codec.sender] = self.collective.codecs[codec.sender] = codec

    def post(self, message: Message, sender: int, seq: int, group, bucket_index: int) -> None:
        transport = self.shared_memory if sender in self.shared_memory.mapped else self.collective
        transport.post(message, sender, seq, group, bucket_index)

    def drain(self) -> None:
        self.collective.drain()
        self.shared_memory.drain()

    def deliver(self, view, message: Message, sender: int, seq: int, verify: bool = True,
                encoded=None, problem: Exception | None = None) -> None:  # fmt: skip
        """Check message `seq` of `sender` (`verify`: one from another rank), then hand it to
        the sink. `encoded`: (header, encoded bytes) to decode into `view` first. `problem`: the
        transport's, found before the checks. After the first error nothing more is loaded."""
        self.remaining -= 1
        if self.error is not None:
            return
        if problem is not None:
            self.error = problem
            return
        payload = None
        try:
            if encoded is not None:
                if self.tamper is not None:  # the encoded bytes, before decoding
                    self.tamper(encoded[1], self.version, seq)
                payload = self._decode(view, sender, seq, *encoded)
                if payload is None:
                    return
            elif verify and self.tamper is not None:
                self.tamper(view, self.version, seq)
            if verify:
                self._verify(view, message, sender, seq)
            start = time.perf_counter()
            pieces = buffers.unpack(view, message, self.dtype)
            self.sink.add(message, pieces, sender, seq, last=self.remaining == 0)
            self.stats.load_s += time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - re-raised once the protocol has finished
            self.error = exc
        if payload is None:
            return
        if self.error is None:
            self.codecs[sender].keep(seq, payload)
        elif self.codecs[sender].delta:
            self.stats.delta_failures += 1  # decoded, but not to what was sent

    def _decode(self, view, sender: int, seq: int, head, body) -> torch.Tensor | None:
        """The message decoded into `view`; its payload as this rank's own tensor, or None (an
        error, recorded)."""
        try:
            return self.codecs[sender].decode(view, seq, head, body)
        except ValueError as exc:
            self.stats.delta_failures += 1
            self.error = RuntimeError(
                f"weight sync v{self.version}: message {seq} from sender global rank {sender} "
                f"to receiver global rank {self.rank} did not decode ({exc}); nothing of it "
                "was loaded"
            )
            return None

    def _verify(self, view, message: Message, sender: int, seq: int) -> None:
        header = buffers.read_header(view)
        got = buffers.payload_checksum(view, message)
        problem = None
        if (header.sender, header.seq) != (sender, seq):
            problem = f"arrived as message {header.seq} of sender {header.sender}"
        elif header.version != self.version:
            problem = f"carries version {header.version}"
        elif header.checksum != got:
            problem = f"failed its checksum (sent {header.checksum:#010x}, got {got:#010x})"
        if problem:
            names = sorted({p.hf_name for p in message.pieces})
            raise RuntimeError(
                f"weight sync v{self.version}: message {seq} from sender global rank {sender} "
                f"to receiver global rank {self.rank} {problem}; parameters {names[:8]}"
                f"{' ...' if len(names) > 8 else ''}; nothing of it was loaded"
            )


def _gather(plan, gather, rank, sender, local, tp_groups, checked) -> torch.Tensor | None:
    """This rank's part in assembling one parameter; the full tensor on the sender."""
    tensor = local[gather.local_name]
    if tensor.dtype != buffers.torch_dtype(plan.dtype):
        raise RuntimeError(
            f"weight sync: parameter {gather.param} on global rank {rank} is {tensor.dtype}, "
            f"the plan was made for {plan.dtype}"
        )
    if not gather.is_collective:
        return tensor
    group = tp_groups[gather.group]
    if gather.group not in checked:
        members = tuple(dist.get_process_group_ranks(group))
        if members != gather.ranks:
            raise RuntimeError(
                f"weight sync: the plan gathers {gather.param} from ranks {gather.ranks} but "
                f"the {gather.group} group of global rank {rank} is {members}"
            )
        checked.add(gather.group)
    tensor = tensor.contiguous()
    shards = [torch.empty_like(tensor) for _ in gather.ranks] if rank == sender else None
    dist.gather(tensor, shards, dst=sender, group=group)
    return unshard(shards, gather.spec) if rank == sender else None


class _Sender:
    """Produce slots and the HF tensors being packed, on a sender; its transport
    (`weight_sync.transports`): the collective one (through the delta codec where agreed) or
    shared memory, as `negotiate` agreed with its group (collective without a negotiation)."""

    def __init__(self, plan, rank, version, group, stats, slot_bytes, pool, device):
        self.plan, self.rank, self.version, self.group = plan, rank, version, group
        self.device = device
        self.stats, self.slot_bytes, self.pool = stats, slot_bytes, pool
        self.dtype = buffers.torch_dtype(plan.dtype)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.staged: dict[str, torch.Tensor] = {}
        self.owned: dict[str, int] = {}
        """Bytes of each staged HF tensor that are this sync's own (not a view of a parameter)."""
        self.seq = 0
        self.transport = None
        """None where the group has no receiver."""
        if dist.get_world_size(group) > 1:
            self.transport = CollectiveSend(rank, group, stats)
        self.codec: DeltaCodec | None = None
        self.offered: SharedMemorySend | None = None

    def offer_shared_memory(self, num_buckets: int) -> list[buffers.SharedHandle]:
        """Allocate the slots in shared memory; their handles, for the receivers to map."""
        self.offered = SharedMemorySend(self.rank, self.group, self.stats, self.pool,
                                        self.slot_bytes, num_buckets)  # fmt: skip
        self.slots[: len(self.offered.slots)] = self.offered.slots
        return self.offered.handles

    def use_shared_memory(self) -> None:
        self.transport = self.offered

    def use_codec(self, codec: DeltaCodec) -> None:
        self.codec = codec
        self.transport = CollectiveSend(self.rank, self.group, self.stats, codec)

    def free_slot(self, index: int) -> torch.Tensor:
        """Slot `index % 2`, once the bucket two back is off it (`wait_slot`: its sends
        completed, or, with shared memory, every receiver acknowledged its last message)."""
        if self.transport is not None:
            self.transport.wait_slot(index)
        k = index % 2
        if self.slots[k] is None:
            self.slots[k] = self.pool.get("produce", k, self.slot_bytes, device=self.device)
            self.stats.counter.add("produce", self.slot_bytes)
        return self.slots[k]

    def stage(self, gather, full: torch.Tensor) -> None:
        """The HF tensors of one assembled parameter, as views of it (packing copies them once).

        A parameter this rank holds whole is not copied at all; a gathered one is this sync's
        own memory until its last piece is packed ("gathered").
        """
        hf = megatron_param_to_hf(gather.param, full, self.plan.dims, copy=False)
        for hf_name, tensor in hf:
            self.staged[hf_name] = tensor
            nbytes = tensor.numel() * tensor.element_size()
            self._own(hf_name, nbytes if gather.is_collective else 0)

    def _own(self, hf_name: str, nbytes: int) -> None:
        self.owned[hf_name] = self.owned.get(hf_name, 0) + nbytes
        self.stats.counter.add("gathered", nbytes)

    def pack(self, slot: torch.Tensor, message: Message) -> tuple[torch.Tensor, int]:
        for piece in message.pieces:  # a tensor split over messages: contiguous, once
            tensor = self.staged[piece.hf_name]
            if not piece.is_whole and not tensor.is_contiguous():
                self.staged[piece.hf_name] = tensor.contiguous()
                self._own(piece.hf_name, tensor.numel() * tensor.element_size())
        view = slot[message.offset : message.offset + message.wire_bytes]
        buffers.pack(view, message, self.staged, self.dtype, version=self.version,
                     sender=self.rank, seq=self.seq)  # fmt: skip
        for param in message.releases:
            for hf_name in hf_names_for(param, self.plan.dims):
                del self.staged[hf_name]
                self.stats.counter.sub("gathered", self.owned.pop(hf_name))
        self.seq += 1
        return view, self.seq - 1

    def send(self, view: torch.Tensor, index: int) -> None:
        """Put a packed message of bucket `index` on the wire."""
        if self.transport is not None:
            self.transport.send(view, index, self.seq - 1)

    def post_last_acks(self) -> None:
        """Before this rank drains as a receiver (`finish_posts`: with shared memory, a
        receiver acknowledges its last messages only then)."""
        if self.transport is not None:
            self.transport.finish_posts()

    def drain(self) -> None:
        if self.transport is not None:
            self.transport.drain()


def run_plan(
    plan: ReshardPlan,
    rank: int,
    version: int,
    sender_groups: dict,
    *,
    local: dict[str, torch.Tensor] | None = None,
    tp_groups: dict | None = None,
    sink: Sink | None = None,
    counter: buffers.MemoryCounter | None = None,
    pool: buffers.BufferPool | None = None,
    transport: str = "auto",
    device: torch.device | None = None,
    tamper=None,
    bases: DeltaBases | None = None,
) -> SyncStats:
    """Take this rank's part in `plan` (collective over every participant).

    `local`/`tp_groups`: the train role's state dict (local names) and its {"tp", "expt_tp"}
    groups, on train ranks. `sink`: on receivers. `counter`: where buffer bytes are counted
    (shared with the sink's own staging). `pool`: where produce and consume slots come from
    (kept for the next sync; by default, allocated for this one). `transport`: "auto" (shared
    memory for a sender whose receivers all map its slots, else broadcast) or "broadcast".
    `device`: where the slots lie (the bridge's: CPU by default; a GPU with NCCL groups for the
    device bridge, where messages are always broadcast whole).
    A receiver's first check or
    sink error is returned in `SyncStats.error` once the whole schedule has run (so that every
    participant reaches the end); any other error is raised where it happens.
    `tamper(view, version, seq)`: fault injection (`faults.weight_corrupt_versions`), called on
    each message a receiver gets from another rank before its checks (with the delta codec: on
    the encoded bytes, before decoding).
    `bases`: this rank's delta bases, kept between syncs (`weight_sync.delta`): the broadcast
    transport then sends through the delta codec (`negotiate`); they are completed at
    `version` when this rank's part ended cleanly, and dropped otherwise.
    """
    stats, wall = SyncStats(counter=counter or buffers.MemoryCounter()), time.perf_counter()
    device = torch.device(device if device is not None else "cpu")
    pool = pool if pool is not None else buffers.BufferPool()
    mine = next((s for s in plan.senders if s.rank == rank), None)
    sender_state = None
    if mine is not None:
        slot_bytes = max(b.nbytes for b in mine.buckets)
        group = sender_groups[rank]
        sender_state = _Sender(plan, rank, version, group, stats, slot_bytes, pool, device)
    seqs = {s.rank: 0 for s in plan.senders}
    receiver = None
    if sink is not None:
        others = [m for s in plan.senders if s.rank != rank for b in s.buckets for m in b.messages]
        total = sum(len(b.messages) for s in plan.senders for b in s.buckets)
        slot = max((m.wire_bytes for m in others), default=0)
        receiver = _Receiver(plan, rank, version, sink, stats, slot, total, pool, device)
        receiver.tamper = tamper
    if bases is not None:
        bases.use_plan(plan)
    try:
        negotiate(plan, rank, sender_groups, sender_state, receiver, transport, stats, device,
                  bases)  # fmt: skip
        checked: set[str] = set()
        for sender_index, bucket_index in plan.schedule:
            sender = plan.senders[sender_index]
            bucket, is_sender = sender.buckets[bucket_index], sender.rank == rank
            slot = sender_state.free_slot(bucket_index) if is_sender else None
            # Message by message: gather what it starts, pack it, put it on the wire. A TP member
            # that is not the sender only takes part in the gathers.
            for message in bucket.messages:
                start = time.perf_counter()
                for gather in message.gathers:
                    if local is not None and rank in gather.ranks:
                        full = _gather(plan, gather, rank, sender.rank, local, tp_groups, checked)
                        if is_sender:
                            sender_state.stage(gather, full)
                if is_sender:
                    view, seq = sender_state.pack(slot, message)
                stats.gather_s += time.perf_counter() - start
                if is_sender:
                    if receiver is not None:
                        # An engine's processes read what they load from shared memory (or a
                        # GPU): a borrowing sink gets its own message copied there unless the slot
                        # is (it is loaded before the slot is written again).
                        own = view
                        if receiver.shared and view.device.type == "cpu" and not view.is_shared():
                            own = buffers.empty_bytes(view.numel(), shared=True)
                            own.copy_(view)
                        receiver.deliver(own, message, rank, seq, verify=False)
                    sender_state.send(view, bucket_index)
            if receiver is not None and not is_sender:
                for message in bucket.messages:
                    group = sender_groups[sender.rank]
                    receiver.post(message, sender.rank, seqs[sender.rank], group, bucket_index)
                    seqs[sender.rank] += 1
        if sender_state is not None:
            sender_state.post_last_acks()
        if receiver is not None:
            receiver.drain()
            stats.error = receiver.error
        if sender_state is not None:
            sender_state.drain()
    except BaseException:
        if bases is not None:
            bases.drop()  # whatever was kept of this version is not a complete one
        raise
    if bases is not None:
        kept = {rank: sender_state.codec.delta} if sender_state and sender_state.codec else {}
        if receiver is not None:
            kept.update({s: codec.delta for s, codec in receiver.codecs.items()})
        bases.finish(version, kept, clean=receiver is None or receiver.error is None)
        stats.counter.add("delta_base", bases.nbytes)
    stats.wall_s = time.perf_counter() - wall
    return stats
