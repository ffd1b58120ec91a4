"""The shared-memory transport: one host, receivers read the sender's produce slots in place.

Owned here: `SharedMemorySend` (produce slots allocated in shared memory, their handles offered
to the receivers, and the acknowledgements that let the sender refill a slot) and
`SharedMemoryReceive` (the senders' slots mapped, a FIFO per sender). Only each message's
32-byte header crosses the group, saying the message is ready; each receiver acknowledges
message k (an all-reduce on the group) once it is loaded, and the sender refills a slot only
after every receiver acknowledged the last message of the bucket two back. A receiver holds no
consume slots, and an engine gets handles to the sender's memory: no byte is copied between
pack and load.

Ordering: every member posts the acknowledgement of message k - 2 just before the header of
message k, and the last two after the schedule (senders post theirs before draining as
receivers, since a rank may be both).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_async_rl.weight_sync.plan import HEADER_BYTES, Message


class SharedMemorySend:
    """A sender's side: its slots in shared memory and the acknowledgements of its messages."""

    def __init__(self, rank: int, group, stats, pool, slot_bytes: int, num_buckets: int):
        self.rank, self.group, self.stats = rank, group, stats
        self.acks: dict[int, object] = {}
        self.bucket_last: dict[int, int] = {}
        self.headers: list[list] = [[], []]
        self.sent = 0
        self.slots = []
        for k in range(min(2, num_buckets)):
            self.slots.append(pool.get("produce", k, slot_bytes, shared=True))
            stats.counter.add("produce", slot_bytes)
        self.handles = [pool.share("produce", k) for k in range(len(self.slots))]
        """For the receivers to map (`SharedMemoryReceive.attach`)."""

    def wait_slot(self, index: int) -> None:
        """Every receiver acknowledged the last message of bucket `index` - 2."""
        start = time.perf_counter()
        self._post_acks(self.sent - 2)  # in message order, as the receivers post theirs
        if index >= 2:
            self.acks[self.bucket_last[index - 2]].wait()
        for work in self.headers[index % 2]:
            work.wait()
        self.headers[index % 2] = []
        self.stats.send_s += time.perf_counter() - start

    def _post_acks(self, upto: int) -> None:
        """Join the acknowledgements of messages up to `upto` (each is an all-reduce)."""
        for seq in range(len(self.acks), upto + 1):
            self.acks[seq] = dist.all_reduce(torch.ones(1), group=self.group, async_op=True)

    def send(self, view: torch.Tensor, index: int, seq: int) -> None:
        """The message's header: it is ready in the slot."""
        self._post_acks(seq - 2)  # acks of messages < seq - 2 precede this header
        work = dist.broadcast(view[:HEADER_BYTES], src=self.rank, group=self.group,
                              async_op=True)  # fmt: skip
        self.headers[index % 2].append(work)
        self.bucket_last[index] = seq
        self.sent = seq + 1

    def finish_posts(self) -> None:
        """Join the acknowledgements not joined yet (before this rank drains as a receiver: a
        receiver acknowledges its last messages only then)."""
        self._post_acks(self.sent - 1)

    def drain(self) -> None:
        start = time.perf_counter()
        for work in self.acks.values():
            work.wait()
        for works in self.headers:
            for work in works:
                work.wait()
        self.stats.send_s += time.perf_counter() - start


class SharedMemoryReceive:
    """A receiver's side: each shared-memory sender's slots, mapped, and its messages in flight."""

    def __init__(self, pool, stats, deliver: Callable[..., None], version: int, rank: int):
        self.pool, self.stats, self.deliver = pool, stats, deliver
        self.version, self.rank = version, rank
        self.mapped: dict[int, list[torch.Tensor]] = {}
        self.queues: dict[int, collections.deque] = {}
        self.acks: list = []

    def attach(self, sender: int, handles) -> None:
        """Map `sender`'s produce slots (raises OSError when they cannot be mapped)."""
        self.mapped[sender] = [
            self.pool.attach(("produce", sender, i), handle) for i, handle in enumerate(handles)
        ]
        self.queues[sender] = collections.deque()

    def detach(self, sender: int) -> None:
        self.mapped.pop(sender, None)
        self.queues.pop(sender, None)

    def post(self, message: Message, sender: int, seq: int, group, bucket_index: int) -> None:
        """Message `seq` of `sender` is in its slot `bucket_index % 2`; its header on the wire
        says it is ready. Message seq - 2 is loaded (and acknowledged) first."""
        queue = self.queues[sender]
        if len(queue) == 2:
            self._complete(sender)
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        work = dist.broadcast(header, src=sender, group=group, async_op=True)
        slot = self.mapped[sender][bucket_index % 2]
        view = slot[message.offset : message.offset + message.wire_bytes]
        queue.append((work, header, view, message, seq, group))

    def _complete(self, sender: int) -> None:
        work, header, view, message, seq, group = self.queues[sender].popleft()
        start = time.perf_counter()
        work.wait()
        self.stats.send_s += time.perf_counter() - start
        announced = None
        if not torch.equal(header, view[:HEADER_BYTES]):
            announced = RuntimeError(
                f"weight sync v{self.version}: message {seq} from sender global rank {sender} "
                f"to receiver global rank {self.rank}: the header announced differs from the "
                "one in shared memory; nothing of it was loaded"
            )
        self.deliver(view, message, sender, seq, problem=announced)
        # The sender may write this slot again once every receiver has acknowledged.
        self.acks.append(dist.all_reduce(torch.ones(1), group=group, async_op=True))

    def drain(self) -> None:
        for sender, queue in self.queues.items():
            while queue:
                self._complete(sender)
        start = time.perf_counter()
        for work in self.acks:
            work.wait()
        self.stats.send_s += time.perf_counter() - start
