"""Weight-sync messages through the delta codec: what both ends keep, and what goes on the wire.

Owned here: `DeltaBases`, one per rank, kept from one sync to the next (`weight_sync.delta:
true`): the bytes of each message as this rank last sent or loaded it; a message's form on the
wire (`encode_message`, `decode_into`): a `DELTA_HEADER_BYTES` header (the message's own
header, then the codec and the length of what follows), then the bytes `weight_sync.delta`
encoded; and `DeltaCodec`, the two as a layer over the collective transport
(`weight_sync.transports.collective`), for one sender's messages on one rank. No process group
here: the transport sends and receives, the executor (`weight_sync.executor`) negotiates
(`weight_sync.negotiate`) and checks.

The rule that keeps bases from drifting: a sender sends a delta only against a version that it
and every receiver of its group hold for all of its messages, as the last sync that completed
cleanly on that rank left them (`held`). A rank whose sync failed in any way (a checksum, a
load, an exception) holds no version (`drop`), so the next sync of that sender is full; so is
the first sync of a process (a resume, a restarted or new rank), a changed plan, and every
`full_every`-th version. A decoded message is then checked with the checksum of the whole
message, as a full one is.

Memory: a sender keeps its own messages' payloads (its share of the model at the engine's
dtype, e.g. one pipeline stage); a receiver keeps the payloads of every sender it receives from
over the broadcast transport (the model at the engine's dtype). Counted as `delta_base`.
"""

from __future__ import annotations

import time

import torch

from megatron_async_rl.weight_sync import delta
from megatron_async_rl.weight_sync.plan import HEADER_BYTES

DELTA_HEADER_BYTES = HEADER_BYTES + 16
"""The message's own 32-byte header (version, checksum of the whole payload, sender, seq), then
int64 codec (0 full, 1 sparse) and int64 length of the encoded bytes that follow."""
CODEC_IDS = {"full": 0, "sparse": 1}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}


class DeltaBases:
    """Per sender rank: the payload of each of its messages (by sequence number) and the
    version they all hold, on the sender itself and on its receivers."""

    def __init__(self, full_every: int = 20):
        self.full_every = full_every
        self.plan_id: object = None
        self._payloads: dict[tuple[int, int], torch.Tensor] = {}
        self._version: dict[int, int] = {}
        self._deltas: dict[int, int] = {}
        """Consecutive delta syncs per sender since its last full one."""

    def use_plan(self, plan_id: object) -> None:
        """Bases belong to one plan (the same messages at the same offsets): another drops them."""
        if plan_id != self.plan_id:
            self.drop()
            self.plan_id = plan_id

    def held(self, sender: int) -> int | None:
        """The version this rank holds complete for `sender`'s messages, or None."""
        return self._version.get(sender)

    def proposal(self, sender: int) -> int | None:
        """The base a sender offers for its next sync: its held version, or None when the
        next sync must be full (`full_every` deltas in a row, or nothing held)."""
        if self._deltas.get(sender, 0) + 1 >= self.full_every:
            return None
        return self.held(sender)

    def base(self, sender: int, seq: int) -> torch.Tensor | None:
        return self._payloads.get((sender, seq))

    def keep(self, sender: int, seq: int, payload: torch.Tensor) -> None:
        """`payload` (this rank's own tensor, not a buffer reused later) is now the base of
        message `seq` of `sender`; until `complete`, `sender` holds no version."""
        self._version.pop(sender, None)
        self._payloads[(sender, seq)] = payload

    def complete(self, sender: int, version: int, delta: bool) -> None:
        """Every message of `sender` at `version` was kept, and the sync ended cleanly here."""
        self._version[sender] = version
        self._deltas[sender] = self._deltas.get(sender, 0) + 1 if delta else 0

    def finish(self, version: int, senders: dict[int, bool], clean: bool) -> None:
        """End of a sync on this rank: `senders` (those whose messages it kept, each with
        whether they came as deltas) hold `version` if its part ended `clean`ly."""
        for sender, was_delta in senders.items():
            if clean:
                self.complete(sender, version, was_delta)
            else:
                self.drop(sender)

    def drop(self, sender: int | None = None) -> None:
        """Forget `sender`'s bases (all senders' with None): its next sync is full."""
        for key in [k for k in self._payloads if sender is None or k[0] == sender]:
            del self._payloads[key]
        for table in (self._version, self._deltas):
            for key in [k for k in table if sender is None or k == sender]:
                del table[key]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._payloads.values())


def encode_message(
    view: torch.Tensor, base: torch.Tensor | None, dtype_width: int,
    spare: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A packed message (`view`: header, then payload) as (header, encoded bytes, the base of
    the message's next version: `base` brought up to the payload in place, or else a copy of
    the payload, into `spare` where it has the payload's length: the old base of a message
    sent whole); a delta against `base` where it is smaller, else the payload whole."""
    payload = view[HEADER_BYTES:]
    size = payload.numel()
    if base is not None and base.numel() == size:
        encoded, kept = delta.encode(payload, base, dtype_width, update_base=True), base
    else:
        encoded = delta.encode(payload, None, dtype_width)
        if spare is not None and spare.numel() == size:
            kept = spare.copy_(payload)
        else:
            kept = payload.clone()
    head = torch.empty(DELTA_HEADER_BYTES, dtype=torch.uint8)
    head[:HEADER_BYTES].copy_(view[:HEADER_BYTES])
    fields = torch.tensor([CODEC_IDS[encoded.codec], encoded.payload.numel()], dtype=torch.int64)
    head[HEADER_BYTES:].view(torch.int64).copy_(fields)
    return head, encoded.payload, kept


def read_length(head: torch.Tensor) -> tuple[int, int]:
    """(codec id, length of the encoded bytes) of a received header."""
    codec, length = head[HEADER_BYTES:].view(torch.int64).tolist()
    if length < 0:
        raise ValueError(f"a delta header announces {length} bytes")
    return codec, length


def decode_into(
    view: torch.Tensor, head: torch.Tensor, codec: int, body: torch.Tensor,
    base: torch.Tensor | None, deltas: bool, dtype_width: int,
) -> torch.Tensor:  # fmt: skip
    """Write the message `head` and `body` stand for into `view` (its header, then its payload,
    to be checked as a whole message is); return the payload as a tensor of its own (the base
    of its next version: `base` itself, updated in place, for a delta). `deltas`: the sender
    agreed to send deltas against `base`. Raises ValueError for what cannot be decoded (`base`
    may then be changed: the caller drops it)."""
    size = view.numel() - HEADER_BYTES
    name = CODEC_NAMES.get(codec)
    if name is None:
        raise ValueError(f"unknown codec id {codec}")
    if name != delta.FULL and not deltas:
        raise ValueError(f"a {name} message from a sender that agreed to send whole ones")
    width = delta.element_width(size, dtype_width)
    payload = delta.decode(delta.Encoded(name, body, size, width), base, in_place=True)
    if payload.numel() != size:
        raise ValueError(f"it decodes to {payload.numel()} bytes, not {size}")
    view[:HEADER_BYTES].copy_(head[:HEADER_BYTES])
    view[HEADER_BYTES:].copy_(payload)
    return payload


class DeltaCodec:
    """The codec of one sender's messages on one rank (the sender, or one of its receivers):
    `transports.collective.Codec` on the sender, `decode` on a receiver. `delta`: the group
    agreed on deltas against the version every member holds (else messages go whole)."""

    header_bytes = DELTA_HEADER_BYTES

    def __init__(self, bases: DeltaBases, sender: int, delta: bool, dtype_width: int, stats):
        self.bases, self.sender, self.delta = bases, sender, delta
        self.width, self.stats = dtype_width, stats

    def encode(self, view: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, encoded bytes) of the packed message `view`; its payload becomes the base
        of its next version."""
        start = time.perf_counter()
        old = self.bases.base(self.sender, seq)
        head, body, kept = encode_message(view, old if self.delta else None, self.width, old)
        self.stats.encode_s += time.perf_counter() - start
        self.stats.wire_bytes += head.numel() + body.numel()
        self.stats.full_bytes += kept.numel()
        self.bases.keep(self.sender, seq, kept)
        return head, body

    def body_bytes(self, head: torch.Tensor) -> int:
        return read_length(head)[1]

    def decode(self, view: torch.Tensor, seq: int, head: torch.Tensor, body: torch.Tensor
               ) -> torch.Tensor:  # fmt: skip
        """`decode_into` against this rank's base of message `seq` (ValueError when it cannot)."""
        self.stats.wire_bytes += head.numel() + body.numel()
        self.stats.full_bytes += view.numel() - HEADER_BYTES
        codec, _ = read_length(head)
        start = time.perf_counter()
        try:
            return decode_into(view, head, codec, body, self.bases.base(self.sender, seq),
                               self.delta, self.width)  # fmt: skip
        finally:
            self.stats.decode_s += time.perf_counter() - start

    def keep(self, seq: int, payload: torch.Tensor) -> None:
        """A decoded message passed its checks: its payload is the base of its next version."""
        self.bases.keep(self.sender, seq, payload)
