"""The collective transport: every message broadcast on its sender's group.

Owned here: `CollectiveSend` (a sender's posted broadcasts, per produce slot) and
`CollectiveReceive` (a receiver's two consume slots, shared by every sender that broadcasts to
it, and the FIFO of messages in flight into them). The same code runs gloo on CPU slots (the
host bridge) and NCCL on CUDA slots (the device bridge). With a `Codec` (the delta codec,
`weight_sync.delta_wire.DeltaCodec`), a sender's messages cross as a fixed-size header
announcing the length of the encoded bytes that follow; a receiver hands both on, for the
executor to decode into the consume slot.

Memory: a receiver holds 2 consume slots of the largest message it receives; a message is
posted into slot k % 2 once message k - 2 was delivered.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_async_rl.weight_sync.plan import Message


class Codec(Protocol):
    """A layer over this transport (`weight_sync.delta_wire.DeltaCodec`): on a sender, a packed
    message in, a fixed-size header and encoded bytes out; a receiver reads the header, learns
    the length of what follows, and hands both to its codec to decode."""

    header_bytes: int

    def encode(self, view: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(header of `header_bytes`, encoded bytes) for the packed message `view`."""

    def body_bytes(self, head: torch.Tensor) -> int:
        """The length of the encoded bytes a received header announces."""


class _Keep:
    """Tensors an asynchronous send reads, kept alive beside its work until it completes."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def wait(self) -> None:
        pass


class CollectiveSend:
    """A sender's side: its broadcasts, per produce slot, waited for before the slot is reused."""

    def __init__(self, rank: int, group, stats, codec: Codec | None = None):
        self.rank, self.group, self.stats, self.codec = rank, group, stats, codec
        self.sends: list[list] = [[], []]

    def wait_slot(self, index: int) -> None:
        start = time.perf_counter()
        for work in self.sends[index % 2]:
            work.wait()
        self.sends[index % 2] = []
        self.stats.send_s += time.perf_counter() - start

    def send(self, view: torch.Tensor, index: int, seq: int) -> None:
        if self.codec is None:
            work = dist.broadcast(view, src=self.rank, group=self.group, async_op=True)
            self.sends[index % 2].append(work)
            return
        head, body = self.codec.encode(view, seq)
        works = [dist.broadcast(head, src=self.rank, group=self.group, async_op=True)]
        if body.numel():
            works.append(dist.broadcast(body, src=self.rank, group=self.group, async_op=True))
        # the tensors stay referenced until their sends complete (`wait_slot`, `drain`)
        self.sends[index % 2] += [*works, _Keep(head, body)]

    def finish_posts(self) -> None:
        pass

    def drain(self) -> None:
        start = time.perf_counter()
        for works in self.sends:
            for work in works:
                work.wait()
        self.stats.send_s += time.perf_counter() - start


class CollectiveReceive:
    """A receiver's side, for every sender that broadcasts to it: two consume slots (from the
    pool; in shared memory where the sink hands views to an engine's processes)."""

    def __init__(self, pool, slot_bytes: int, shared: bool, device, stats,
                 deliver: Callable[..., None]):  # fmt: skip
        self.pool, self.slot_bytes, self.shared, self.device = pool, slot_bytes, shared, device
        self.stats, self.deliver = stats, deliver
        self.slots: list[torch.Tensor | None] = [None, None]
        self.in_flight: collections.deque = collections.deque()
        self.posted = 0
        self.codecs: dict[int, Codec] = {}
        """Senders whose messages come through a codec."""

    def post(self, message: Message, sender: int, seq: int, group, bucket_index: int) -> None:
        index = self.posted % 2
        if len(self.in_flight) == 2:
            self.complete_oldest()
        if self.slots[index] is None:
            self.slots[index] = self.pool.get(
                "consume", index, self.slot_bytes, self.shared, self.device
            )
            self.stats.counter.add("consume", self.slot_bytes)
        view = self.slots[index][: message.wire_bytes]
        codec, encoded = self.codecs.get(sender), None
        if codec is not None:  # the header, with the length of the bytes that follow
            head = torch.empty(codec.header_bytes, dtype=torch.uint8)
            start = time.perf_counter()
            dist.broadcast(head, src=sender, group=group)
            self.stats.send_s += time.perf_counter() - start
            body = torch.empty(codec.body_bytes(head), dtype=torch.uint8)
            work = None
            if body.numel():
                work = dist.broadcast(body, src=sender, group=group, async_op=True)
            encoded = (head, body)
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
        self.deliver(view, message, sender, seq, encoded=encoded)

    def drain(self) -> None:
        while self.in_flight:
            self.complete_oldest()
