"""Byte buffers of weight sync: message packing, headers, checksums, tensor reassembly, counters.

Owned here: how one planned `Message` lies in a flat uint8 buffer (a 32-byte header of int64
version, checksum, sender rank and sequence number, then each piece at its planned offset), the
checksum (63 bits of xxHash's XXH3-64 of the payload, computed by the sender and verified by
every receiver before anything is loaded), `Assembler` (pieces of split HF tensors back into
whole tensors), `BufferPool` (the buffers a rank reuses from one sync to the next) and
`MemoryCounter` (peak bytes held in each kind of buffer, reported as metrics and asserted by
tests). Called by `weight_sync.executor` and `weight_sync.sinks`; pure torch, no collectives,
so the unit tests pack and unpack through this very code.

Costs that shaped it (measured on the 2-core CPU machines, 241 MiB): CRC-32 130 ms, XXH3 23 ms;
a copy ~85 ms; fresh memory costs as much as a copy (page faults: 128 MiB of new anonymous or
shared memory 65-110 ms to allocate and touch), hence the pool; and a CPU tensor handed to an
engine process crosses as a shared-memory handle only if its storage already is in shared
memory: otherwise torch copies it there, per storage (39 separate tensors: 4-14 s; the same
bytes as views of one shared buffer: 85 ms). Buffers that go to an engine are therefore
allocated in shared memory (`empty_bytes(shared=True)`), and many tensors share one storage.
"""

from __future__ import annotations

import functools
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import xxhash

from megatron_async_rl.weight_sync.plan import HEADER_BYTES, Message, Piece


@dataclass(frozen=True)
class Header:
    version: int
    checksum: int
    sender: int
    seq: int


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


CHECKSUM_MASK = (1 << 63) - 1


def checksum(payload: torch.Tensor) -> int:
    """The checksum of a contiguous uint8 tensor, 63 bits (it is stored as an int64): XXH3-64
    of a CPU tensor, `device_checksum` of a GPU one (its bytes never leave the device). Sender
    and receivers of a message hold it on the same kind of device (the sync's bridge)."""
    if payload.device.type != "cpu":
        return device_checksum(payload)
    return xxhash.xxh3_64_intdigest(payload.numpy()) & CHECKSUM_MASK


DEVICE_CHECKSUM_WORDS = 1 << 20
"""int64 words one step of `device_checksum` reads (8 MiB: its temporary is as large)."""


@functools.lru_cache(maxsize=8)
def _checksum_weights(device: str) -> torch.Tensor:
    """DEVICE_CHECKSUM_WORDS fixed odd pseudo-random int64 weights (the same on every rank)."""
    gen = torch.Generator().manual_seed(0x5EED_C0DE)
    words = torch.randint(-(1 << 62), 1 << 62, (DEVICE_CHECKSUM_WORDS,), generator=gen)
    return (words * 2 + 1).to(device)


def device_checksum(payload: torch.Tensor) -> int:
    """A checksum computed with torch ops where `payload` (contiguous uint8) lies, 63 bits.

    The payload as int64 words (a tail of < 8 bytes as single bytes), each multiplied by a
    fixed odd weight by position within its 8 MiB step, summed with two's-complement wrap,
    the step sums weighted by 2 * step + 1. Integer sums do not depend on reduction order, so
    any device gives the same value. Any single changed word changes it (odd weights are
    invertible mod 2**64), as do swapped steps. Not XXH3 (no GPU kernel of it here), nor
    `torch.hash_tensor` (an XOR of the words: blind to their order); one pass over the bytes,
    with temporaries of one step.
    """
    whole = payload.numel() // 8 * 8
    words = payload[:whole]
    if words.storage_offset() % 8:
        words = words.clone()  # int64 views need 8-byte aligned starts
    words = words.view(torch.int64)
    weights = _checksum_weights(str(payload.device))
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    for step, start in enumerate(range(0, words.numel(), DEVICE_CHECKSUM_WORDS)):
        chunk = words[start : start + DEVICE_CHECKSUM_WORDS]
        total += (chunk * weights[: chunk.numel()]).sum() * (2 * step + 1)
    tail = payload[whole:]
    if tail.numel():
        total += (tail.to(torch.int64) * weights[: tail.numel()]).sum() * -1
    return int(total.item()) & CHECKSUM_MASK


def empty_bytes(nbytes: int, shared: bool = False, device=None) -> torch.Tensor:
    """A new uint8 buffer, on the CPU unless `device` says otherwise; a CPU one in shared memory
    when `shared` (handed to an engine as a handle; a GPU one crosses as a CUDA IPC handle)."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (any strides) into the contiguous `dst` of as many elements, row-major."""
    dst.view(src.shape).copy_(src)


ARENA_ALIGN = 64
"""Bytes each tensor's start in a `shared_arena` is aligned to."""


def shared_arena(
    specs, pool: BufferPool | None = None, pinned: bool = False
) -> tuple[dict[str, torch.Tensor], int]:
    """One view per (name, shape, dtype) of `specs`, all of one shared-memory buffer (the
    pool's ("staging", 0) buffer when given, pinned as `BufferPool.get` says, else a new one),
    each start aligned to ARENA_ALIGN bytes; and the buffer's size. Handed to an engine, they
    cross as one handle."""
    spans, total = [], 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        spans.append((name, total, nbytes, shape, dtype))
        total += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
    if pool is not None:
        arena = pool.get("staging", 0, total, shared=True, pinned=pinned)
    else:
        arena = empty_bytes(total, shared=True)
    views = {
        name: arena[start : start + nbytes].view(dtype).view(shape)
        for name, start, nbytes, shape, dtype in spans
    }
    return views, total


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
    """Write `message` (its pieces taken from whole HF tensors in `staged`) into `buf`.

    A tensor in `staged` may be any view of the right row-major order (e.g. q of a fused QKV);
    one split over several messages should be contiguous (else each piece copies it whole).
    """
    payload = buf[HEADER_BYTES : message.wire_bytes]
    itemsize = dtype.itemsize
    for piece in message.pieces:
        src = staged[piece.hf_name]
        dst = payload[piece.offset : piece.offset + piece.numel * itemsize].view(dtype)
        if piece.is_whole:
            copy_into(dst, src)  # one (strided) copy, whatever view the HF tensor is
        else:
            dst.copy_(src.reshape(-1)[piece.start : piece.stop])
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
    piece arrives; the staged bytes are counted under `kind` in `counter`. With a `pool`, that
    buffer is the pool's ("split", key) buffer: the caller passes a key (e.g. the sender) under
    which at most one tensor is staged at a time, and releases it before the next one starts.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        counter: MemoryCounter,
        kind: str = "staging",
        shared: bool = False,
        pool: BufferPool | None = None,
    ):
        self.dtype, self.counter, self.kind, self.shared = dtype, counter, kind, shared
        self.pool = pool
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, piece: Piece, values: torch.Tensor, key: int = 0) -> torch.Tensor | None:
        """The whole tensor once `piece` completes it (a view of `values` if it is whole)."""
        if piece.is_whole:
            return values.view(piece.shape)
        full, filled = self._partial.get(piece.hf_name, (None, 0))
        if full is None:
            nbytes = math.prod(piece.shape) * self.dtype.itemsize
            if self.pool is not None:
                buf = self.pool.get("split", key, nbytes, self.shared, values.device)
            else:
                buf = empty_bytes(nbytes, self.shared, values.device)
            full = buf.view(self.dtype).view(piece.shape)
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


@dataclass(frozen=True)
class SharedHandle:
    """Where another process on the same host finds a shared buffer: /proc/<pid>/fd/<fd>.

    The host (name and boot id) and the file's identity (device, inode) are checked by
    `attach` before anything is mapped: a pid and fd number alone could name another file."""

    host: str
    boot_id: str
    pid: int
    fd: int
    nbytes: int
    file: tuple[int, int]
    """(st_dev, st_ino) of the shared-memory file."""
    uid: int
    """Changes whenever the owner allocates the buffer anew (fd numbers are reused)."""


def _host() -> tuple[str, str]:
    """This machine's host name and boot id (two containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


class BufferPool:
    """Buffers one rank reuses from one weight sync to the next, by (kind, index).

    Whoever syncs repeatedly (the jobs, the benchmark) holds one and passes it to every sync:
    it keeps what a sync used (within the configured bound: 2 produce slots, 2 consume slots,
    or the staging of one model), so later syncs neither allocate nor fault pages. A buffer is
    replaced when a sync needs it larger or in the other kind of memory. Without a pool, a sync
    allocates its buffers and frees them when it returns. A shared buffer can be `share`d with
    processes on the same host, which `attach` it (the mappings are kept here too).
    """

    def __init__(self):
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._uids: dict[tuple[str, int], int] = {}
        self._attached: dict[tuple, tuple[int, torch.Tensor]] = {}
        self._pinned: set[tuple[str, int]] = set()
        self._next_uid = 0
        self.delta_bases = None
        """`weight_sync.delta_wire.DeltaBases`: what this rank last sent or loaded of each
        message, kept with the buffers from one sync to the next (`weight_sync.delta`)."""

    def get(
        self, kind: str, index: int, nbytes: int, shared: bool = False, device=None,
        pinned: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """A uint8 buffer of `nbytes` on `device` (CPU by default); its old contents, if any,
        are garbage. `shared`: in shared memory, on the CPU. `pinned`: a CPU buffer page-locked
        for the GPU's copies (CUDA's host registration, as torch's checkpoint stager pins
        shared memory) where CUDA is in use; unregistered before it is replaced."""
        key = (kind, index)
        buf = self._buffers.get(key)
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            raise ValueError(
                f"BufferPool.get({kind!r}, {index}): device {device} has no index; pass the "
                "rank's device (Platform.device()), not the calling thread's current one"
            )
        on_cpu = device.type == "cpu"
        if (
            buf is None
            or buf.numel() < nbytes
            or buf.device != device
            or (on_cpu and buf.is_shared() != shared)
        ):
            self._unpin(key)
            self._buffers.pop(key, None)  # freed before the new one is allocated
            buf = self._buffers[key] = empty_bytes(nbytes, shared, device)
            self._uids[key], self._next_uid = self._next_uid, self._next_uid + 1
        if pinned and on_cpu and key not in self._pinned and torch.cuda.is_available():
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.pin_memory(buf.data_ptr(), buf.untyped_storage().nbytes())
            self._pinned.add(key)
        return buf[:nbytes]

    def _unpin(self, key) -> None:
        if key in self._pinned:
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.unpin_memory(self._buffers[key].data_ptr())
            self._pinned.discard(key)

    @property
    def allocations(self) -> int:
        """Buffers allocated so far (a sync that reuses every buffer adds none)."""
        return self._next_uid

    def is_pinned(self, kind: str, index: int) -> bool:
        return (kind, index) in self._pinned

    def share(self, kind: str, index: int) -> SharedHandle:
        """The handle of shared buffer (kind, index), for `attach` in another process."""
        storage = self._buffers[(kind, index)].untyped_storage()
        fd, nbytes = storage._share_fd_cpu_()
        stat = os.fstat(fd)
        host, boot = _host()
        file = (stat.st_dev, stat.st_ino)
        return SharedHandle(host, boot, os.getpid(), fd, nbytes, file, self._uids[(kind, index)])

    def attach(self, key, handle: SharedHandle) -> torch.Tensor:
        """Map another process's shared buffer (kept under `key` until its uid changes).

        Raises OSError when it cannot be mapped: another host, /proc/<pid>/fd not open to this
        process, or a file that is not the one the handle names."""
        identity = (handle.host, handle.boot_id, handle.pid, handle.uid)
        held = self._attached.get(key)
        if held is not None and held[0] == identity:
            return held[1]
        self._attached.pop(key, None)
        if (handle.host, handle.boot_id) != _host():
            raise OSError(f"buffer on host {handle.host} (boot {handle.boot_id}), not this one")
        fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDWR)
        try:
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino) != handle.file or stat.st_size < handle.nbytes:
                raise OSError(f"/proc/{handle.pid}/fd/{handle.fd} is not the buffer shared")
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, handle.nbytes)
        finally:
            os.close(fd)
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._attached[key] = (identity, tensor)
        return tensor

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers this pool allocated (attached ones are their owner's)."""
        return sum(buf.untyped_storage().nbytes() for buf in self._buffers.values())
