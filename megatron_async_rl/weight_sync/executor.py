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

Transports, agreed per sender at the start of each sync (`negotiate`, over the sender's
group): when every receiver runs on the sender's host and can map its produce slots (shared
memory, `BufferPool.share` / `attach`), receivers read each message in place and the wire
carries only its 32-byte header ("ready"); each receiver acknowledges message k (an all-reduce
on the group) once it is loaded, and the sender refills a slot only after every receiver
acknowledged the last message of the bucket two back. A receiver then holds no consume slots,
and an engine gets handles to the sender's memory: no byte is copied between pack and load.
Otherwise (another host, or `transport: broadcast`) each message is broadcast whole, or, with
delta bases (`weight_sync.delta`), through the delta codec (`weight_sync.delta_wire`): a
48-byte header with the encoded length, then a delta against the version every member of the
group holds (or the message whole), decoded into the receiver's consume slot and checked there
as a whole message is. On the
device bridge (`WeightSyncConfig.bridge`: GPU slots, NCCL groups) messages are always broadcast
whole and nothing is negotiated; engines get CUDA views (`engines.sglang.handover`: CUDA IPC).

Ordering contract (why nothing deadlocks): every rank walks `plan.schedule` in the same order
and posts, in that order, only the operations it takes part in; it only ever waits for an
operation it posted earlier. On a shared-memory group every member posts the acknowledgement
of message k - 2 just before the header of message k, and the last two after the schedule
(senders post theirs before draining as receivers, since a rank may be both). A receiver
checks each message (version, sender, sequence number, checksum) before its sink sees it;
after the first failure it keeps receiving (so that no sender waits forever) but loads nothing
more, and reports the failure at the end (`SyncStats.error`).
Every collective names `group=`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_async_rl.models.names import hf_names_for, megatron_param_to_hf
from megatron_async_rl.models.shards import unshard
from megatron_async_rl.weight_sync import buffers, delta_wire
from megatron_async_rl.weight_sync.delta_wire import DELTA_HEADER_BYTES, DeltaBases
from megatron_async_rl.weight_sync.negotiate import negotiate
from megatron_async_rl.weight_sync.plan import HEADER_BYTES, Message, Piece, ReshardPlan

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
    """Consume slots and the FIFO of messages in flight to this rank (broadcast transport);
    the senders' mapped slots and a FIFO per sender (shared-memory transport)."""

    def __init__(self, plan, rank, version, sink, stats, slot_bytes, num_messages, pool, device):
        self.plan, self.rank, self.version, self.sink, self.stats = plan, rank, version, sink, stats
        self.device = device
        self.dtype = buffers.torch_dtype(plan.dtype)
        self.pool, self.shared = pool, getattr(sink, "borrows_buffers", True)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.slot_bytes, self.remaining = slot_bytes, num_messages
        self.in_flight: collections.deque = collections.deque()
        self.posted = 0
        self.error: Exception | None = None
        self.mapped: dict[int, list[torch.Tensor]] = {}
        """Shared-memory senders: their produce slots, mapped here."""
        self.queues: dict[int, collections.deque] = {}
        self.acks: list = []
        self.tamper = None
        """`run_plan`'s fault injection hook, if any."""
        self.bases: DeltaBases | None = None
        self.encoded: set[int] = set()
        """Senders whose messages come through the delta codec (a header, then encoded bytes)."""
        self.delta: set[int] = set()
        """Of those, the ones sending deltas against this rank's bases."""

    def attach(self, sender: int, handles) -> None:
        """Map `sender`'s produce slots (raises OSError when they cannot be mapped)."""
        self.mapped[sender] = [
            self.pool.attach(("produce", sender, i), handle) for i, handle in enumerate(handles)
        ]
        self.queues[sender] = collections.deque()

    def post(self, message: Message, sender: int, seq: int, group, bucket_index: int) -> None:
        if sender in self.mapped:
            self._post_shared(message, sender, seq, group, bucket_index)
            return
        index = self.posted % 2
        if len(self.in_flight) == 2:
            self.complete_oldest()
        if self.slots[index] is None:
            self.slots[index] = self.pool.get(
                "consume", index, self.slot_bytes, self.shared, self.device
            )
            self.stats.counter.add("consume", self.slot_bytes)
        view = self.slots[index][: message.wire_bytes]
        encoded = None
        if sender in self.encoded:  # its length first, then the bytes
            head = torch.empty(DELTA_HEADER_BYTES, dtype=torch.uint8)
            start = time.perf_counter()
            dist.broadcast(head, src=sender, group=group)
            self.stats.send_s += time.perf_counter() - start
            codec, length = delta_wire.read_length(head)
            body = torch.empty(length, dtype=torch.uint8)
            work = dist.broadcast(body, src=sender, group=group, async_op=True) if length else None
            encoded = (head, codec, body)
        else:
            work = dist.broadcast(view, src=sender, group=group, async_op=True)
        self.in_flight.append((work, view, message, sender, seq, encoded))
        self.posted += 1

    def complete_oldest(self) -> None:
        work, view, message, sender, seq, encoded = self.in_flight.popleft()
        start = time.perf_counter()
        if work is not None:
            work.wait()
        self.stats.send_s += time.perf_counter() - start
        if encoded is None:
            self.deliver(view, message, sender, seq, verify=True)
            return
        payload = self._decode(view, message, sender, seq, *encoded)
        self.deliver(view, message, sender, seq, verify=True, tamper=False)
        if self.error is None and payload is not None and self.bases is not None:
            self.bases.keep(sender, seq, payload)
        elif self.error is not None and sender in self.delta and payload is not None:
            self.stats.delta_failures += 1  # decoded, but not to what was sent

    def _decode(self, view, message: Message, sender: int, seq: int, head, codec: int, body):
        """The message's payload decoded from `body` into `view`; the payload as this rank's
        own tensor, or None (an error, recorded)."""
        if self.error is not None:
            return None
        self.stats.wire_bytes += DELTA_HEADER_BYTES + body.numel()
        self.stats.full_bytes += message.wire_bytes - HEADER_BYTES
        if self.tamper is not None:
            self.tamper(body, self.version, seq)
        start = time.perf_counter()
        base = self.bases.base(sender, seq) if self.bases is not None else None
        try:
            return delta_wire.decode_into(view, head, codec, body, base, sender in self.delta,
                                          self.dtype.itemsize)  # fmt: skip
        except ValueError as exc:
            self.stats.delta_failures += 1
            self.error = RuntimeError(
                f"weight sync v{self.version}: message {seq} from sender global rank {sender} "
                f"to receiver global rank {self.rank} did not decode ({exc}); nothing of it "
                "was loaded"
            )
            return None
        finally:
            self.stats.decode_s += time.perf_counter() - start

    def _post_shared(self, message: Message, sender: int, seq: int, group, bucket_index) -> None:
        """Message `seq` of `sender` is in its slot `bucket_index % 2`; its header on the wire
        says it is ready. Message seq - 2 is loaded (and acknowledged) first."""
        queue = self.queues[sender]
        if len(queue) == 2:
            self._complete_shared(sender)
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        work = dist.broadcast(header, src=sender, group=group, async_op=True)
        slot = self.mapped[sender][bucket_index % 2]
        view = slot[message.offset : message.offset + message.wire_bytes]
        queue.append((work, header, view, message, seq, group))

    def _complete_shared(self, sender: int) -> None:
        work, header, view, message, seq, group = self.queues[sender].popleft()
        start = time.perf_counter()
        work.wait()
        self.stats.send_s += time.perf_counter() - start
        if self.error is None and not torch.equal(header, view[:HEADER_BYTES]):
            self.error = RuntimeError(
                f"weight sync v{self.version}: message {seq} from sender global rank {sender} "
                f"to receiver global rank {self.rank}: the header announced differs from the "
                "one in shared memory; nothing of it was loaded"
            )
        self.deliver(view, message, sender, seq, verify=True)
        # The sender may write this slot again once every receiver has acknowledged.
        self.acks.append(dist.all_reduce(torch.ones(1), group=group, async_op=True))

    def drain(self) -> None:
        while self.in_flight:
            self.complete_oldest()
        for sender, queue in self.queues.items():
            while queue:
                self._complete_shared(sender)
        start = time.perf_counter()
        for work in self.acks:
            work.wait()
        self.stats.send_s += time.perf_counter() - start

    def deliver(self, view, message: Message, sender: int, seq: int, verify: bool,
                tamper: bool = True) -> None:  # fmt: skip
        self.remaining -= 1
        if self.error is not None:
            return
        try:
            if verify:
                if tamper and self.tamper is not None:
                    self.tamper(view, self.version, seq)
                self._verify(view, message, sender, seq)
            start = time.perf_counter()
            pieces = buffers.unpack(view, message, self.dtype)
            self.sink.add(message, pieces, sender, seq, last=self.remaining == 0)
            self.stats.load_s += time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - re-raised once the protocol has finished
            self.error = exc

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
    """Produce slots, in-flight sends and the HF tensors being packed, on a sender."""

    def __init__(self, plan, rank, version, group, stats, slot_bytes, pool, device):
        self.plan, self.rank, self.version, self.group = plan, rank, version, group
        self.device = device
        self.stats, self.slot_bytes, self.pool = stats, slot_bytes, pool
        self.dtype = buffers.torch_dtype(plan.dtype)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.sends: list[list] = [[], []]
        self.shared_memory = False
        """Receivers read the slots in place (shared memory); only headers go on the wire."""
        self.acks: dict[int, object] = {}
        self.bucket_last: dict[int, int] = {}
        self.staged: dict[str, torch.Tensor] = {}
        self.owned: dict[str, int] = {}
        """Bytes of each staged HF tensor that are this sync's own (not a view of a parameter)."""
        self.seq = 0
        self.bases: DeltaBases | None = None
        """Set when this sender's messages go through the delta codec (`negotiate`)."""
        self.delta = False
        """Deltas against `bases` (every member of the group holds their version)."""

    def offer_shared_memory(self, num_buckets: int) -> list[buffers.SharedHandle]:
        """Allocate the slots in shared memory; their handles, for the receivers to map."""
        for k in range(min(2, num_buckets)):
            self.slots[k] = self.pool.get("produce", k, self.slot_bytes, shared=True)
            self.stats.counter.add("produce", self.slot_bytes)
        return [self.pool.share("produce", k) for k in range(min(2, num_buckets))]

    def free_slot(self, index: int) -> torch.Tensor:
        """Slot `index % 2`, once the bucket two back is off it: its sends completed, or (shared
        memory) every receiver acknowledged its last message."""
        k = index % 2
        start = time.perf_counter()
        if self.shared_memory:
            self._post_acks(self.seq - 2)  # in message order, as the receivers post theirs
            if index >= 2:
                self.acks[self.bucket_last[index - 2]].wait()
        for work in self.sends[k]:
            work.wait()
        self.sends[k] = []
        self.stats.send_s += time.perf_counter() - start
        if self.slots[k] is None:
            self.slots[k] = self.pool.get("produce", k, self.slot_bytes, device=self.device)
            self.stats.counter.add("produce", self.slot_bytes)
        return self.slots[k]

    def _post_acks(self, upto: int) -> None:
        """Join the acknowledgements of messages up to `upto` (each is an all-reduce)."""
        for seq in range(len(self.acks), upto + 1):
            self.acks[seq] = dist.all_reduce(torch.ones(1), group=self.group, async_op=True)

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
        """Put a packed message on the wire (shared memory: its header, saying it is ready)."""
        if dist.get_world_size(self.group) > 1:
            if self.shared_memory:
                self._post_acks(self.seq - 3)  # acks of messages < seq - 2 precede this header
                view = view[:HEADER_BYTES]
            if self.bases is not None:
                self._send_encoded(view, index)
            else:
                work = dist.broadcast(view, src=self.rank, group=self.group, async_op=True)
                self.sends[index % 2].append(work)
            self.bucket_last[index] = self.seq - 1

    def _send_encoded(self, view: torch.Tensor, index: int) -> None:
        """The message through the delta codec (`delta_wire.encode_message`); its payload
        becomes the base of its next version."""
        seq = self.seq - 1
        start = time.perf_counter()
        base = self.bases.base(self.rank, seq) if self.delta else None
        head, body, kept = delta_wire.encode_message(view, base, self.dtype.itemsize)
        self.stats.encode_s += time.perf_counter() - start
        works = [dist.broadcast(head, src=self.rank, group=self.group, async_op=True)]
        if body.numel():
            works.append(dist.broadcast(body, src=self.rank, group=self.group, async_op=True))
        # the tensors stay referenced until their sends complete (`free_slot`, `drain`)
        self.sends[index % 2] += [*works, _Keep(head, body)]
        self.stats.wire_bytes += head.numel() + body.numel()
        self.stats.full_bytes += kept.numel()
        self.bases.keep(self.rank, seq, kept)

    def post_last_acks(self) -> None:
        """Join the acknowledgements not joined yet (before this rank drains as a receiver: a
        receiver acknowledges its last messages only then)."""
        if self.shared_memory:
            self._post_acks(self.seq - 1)

    def drain(self) -> None:
        start = time.perf_counter()
        for work in self.acks.values():
            work.wait()
        for works in self.sends:
            for work in works:
                work.wait()
        self.stats.send_s += time.perf_counter() - start


class _Keep:
    """Tensors an asynchronous send reads, kept alive beside its work until it completes."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def wait(self) -> None:
        pass


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
        if receiver is not None:
            receiver.bases = bases
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
                        receiver.deliver(own, message, rank, seq, False)
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
        kept = {rank: sender_state.delta} if sender_state and sender_state.bases else {}
        if receiver is not None:
            kept.update({s: s in receiver.delta for s in receiver.encoded})
        bases.finish(version, kept, clean=receiver is None or receiver.error is None)
        stats.counter.add("delta_base", bases.nbytes)
    stats.wall_s = time.perf_counter() - wall
    return stats

