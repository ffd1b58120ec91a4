"""Byte buffers of weight sync: message packing, headers, checksums, tensor reassembly, counters.

Owned here: how one planned `Message` lies in a flat uint8 buffer (a 32-byte header of int64
version, checksum, sender rank and sequence number, then each piece at its planned offset), the
checksum (CRC-32 of the payload: cheap, deterministic, computed by the sender and verified by
every receiver before anything is loaded), `Assembler` (pieces of split HF tensors back into
whole tensors) and `MemoryCounter` (peak bytes held in each kind of buffer, reported as metrics
and asserted by tests). Called by `weight_sync.executor` and `weight_sync.sinks`; pure torch,
no collectives, so the unit tests pack and unpack through this very code.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_async_rl.weight_sync.plan import HEADER_BYTES, Message, Piece


@dataclass(frozen=True)
class Header:
    version: int
    checksum: int
    sender: int
    seq: int


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def checksum(payload: torch.Tensor) -> int:
    """CRC-32 of a contiguous uint8 CPU tensor."""
    return zlib.crc32(payload.numpy())


def pack(
    buf: torch.Tensor,
    message: Message,
    staged: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    version: int,
    sender: int,
    seq: int,
) -> None:
    """Write `message` (its pieces taken from whole HF tensors in `staged`) into `buf`."""
    payload = buf[HEADER_BYTES : message.wire_bytes]
    for piece in message.pieces:
        flat = staged[piece.hf_name].reshape(-1)
        itemsize = flat.element_size()
        dst = payload[piece.offset : piece.offset + piece.numel * itemsize].view(dtype)
        dst.copy_(flat[piece.start : piece.stop])
    header = torch.tensor([version, checksum(payload), sender, seq], dtype=torch.int64)
    buf[:HEADER_BYTES].view(torch.int64).copy_(header)


def read_header(buf: torch.Tensor) -> Header:
    version, crc, sender, seq = buf[:HEADER_BYTES].view(torch.int64).tolist()
    return Header(version, crc, sender, seq)


def payload_checksum(buf: torch.Tensor, message: Message) -> int:
    return checksum(buf[HEADER_BYTES : message.wire_bytes])


def unpack(
    buf: torch.Tensor, message: Message, dtype: torch.dtype
) -> list[tuple[Piece, torch.Tensor]]:
    """Views (1-D, no copy) of every piece of a received `message` in `buf`."""
    payload = buf[HEADER_BYTES : message.wire_bytes]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return [
        (piece, payload[piece.offset : piece.offset + piece.numel * itemsize].view(dtype))
        for piece in message.pieces
    ]


class MemoryCounter:
    """Live and peak bytes per buffer kind (e.g. produce, consume, staging)."""

    def __init__(self):
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def add(self, kind: str, nbytes: int) -> None:
        self.live[kind] = self.live.get(kind, 0) + nbytes
        self.peak[kind] = max(self.peak.get(kind, 0), self.live[kind])

    def sub(self, kind: str, nbytes: int) -> None:
        self.live[kind] -= nbytes


class Assembler:
    """Reassembles HF tensors from pieces; whole pieces pass through without a copy.

    A tensor cut into several pieces is staged in a buffer of its full size until its last
    piece arrives; the staged bytes are counted under `kind` in `counter`.
    """

    def __init__(self, dtype: torch.dtype, counter: MemoryCounter, kind: str = "staging"):
        self.dtype, self.counter, self.kind = dtype, counter, kind
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, piece: Piece, values: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor once `piece` completes it (a view of `values` if it is whole)."""
        if piece.is_whole:
            return values.view(piece.shape)
        full, filled = self._partial.get(piece.hf_name, (None, 0))
        if full is None:
            full = torch.empty(piece.shape, dtype=self.dtype)
            self.counter.add(self.kind, full.numel() * full.element_size())
        full.view(-1)[piece.start : piece.stop].copy_(values)
        filled += piece.numel
        if filled < full.numel():
            self._partial[piece.hf_name] = (full, filled)
            return None
        self._partial.pop(piece.hf_name, None)
        return full

    def release(self, piece: Piece, tensor: torch.Tensor) -> None:
        """Uncount the tensor `add` returned for `piece` once it is loaded (if it was staged)."""
        if not piece.is_whole:
            self.counter.sub(self.kind, tensor.numel() * tensor.element_size())

    @property
    def pending(self) -> list[str]:
        return sorted(self._partial)
