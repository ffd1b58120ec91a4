"""How a call's tensors cross to an engine's processes: one handle, pickled where they live.

Owned here: `FlatBucket` and `flatten` (pure), and `serialize` (the payloads of SGLang's
`update_weights_from_tensor`, made in the calling process). `SGLangEngine.update_weights`
serializes what it loads; its host passes the bytes through untouched to the scheduler(s),
which deserialize them with SGLang's own `MultiprocessingSerializer`; views of one buffer go
as SGLang's `flattened_bucket` load format, which rebuilds the named views there.

Why flat: torch's multiprocessing pickler shares every tensor's storage on its own, and the
receiving process fetches each handle over a connection of its own (a file descriptor on
CPU, a CUDA IPC handle on GPU). A weight-sync message holds tens of tensors that are views of
one buffer (a produce slot, a staging arena); as one flat span, one handle crosses.
Why here and not in the host: torch refuses to share again a CUDA tensor it received over IPC
("Attempting to send tensor received from another process"), so the handles must be made by
the process that owns the memory, once per engine TP rank (each rank opens its own: CUDA IPC
reference counts and file-descriptor hand-overs are one-shot), as `sglang.Engine` does.
"""

from __future__ import annotations

import dataclasses
import io
import types
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor pickling (shared memory, CUDA IPC)


@dataclasses.dataclass(frozen=True)
class FlatEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    """Byte offset of the tensor in the bucket's flat tensor."""
    end: int


@dataclasses.dataclass(frozen=True)
class FlatBucket:
    """A uint8 span of one storage and where each named tensor lies in it."""

    tensor: torch.Tensor
    entries: tuple[FlatEntry, ...]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The named tensors again, as views of `tensor` (what the receiving side rebuilds)."""
        return [
            (e.name, self.tensor[e.start : e.end].view(e.dtype).view(e.shape)) for e in self.entries
        ]


def flatten(named: list[tuple[str, torch.Tensor]]) -> FlatBucket | None:
    """`named` as one span of their common storage, or None when they do not share one.

    Every tensor must be contiguous, on the same device and in the same storage; the span runs
    from the lowest first byte to the highest last byte (bytes between tensors, such as a
    message header, cross too: they are in shared memory already, nothing is copied).
    """
    if not named:
        return None
    first = named[0][1]
    base = first.untyped_storage()
    spans = []
    for name, tensor in named:
        if tensor.device != first.device or not tensor.is_contiguous():
            return None
        if tensor.untyped_storage().data_ptr() != base.data_ptr():
            return None
        start = tensor.storage_offset() * tensor.element_size()
        spans.append((name, tensor, start, start + tensor.numel() * tensor.element_size()))
    low = min(s[2] for s in spans)
    high = max(s[3] for s in spans)
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(base, low, (high - low,))
    entries = tuple(
        FlatEntry(name, tuple(t.shape), t.dtype, start - low, end - low)
        for name, t, start, end in spans
    )
    return FlatBucket(flat, entries)


def serialize(named: list[tuple[str, torch.Tensor]], copies: int) -> tuple[list[bytes], str | None]:
    """`copies` payloads of `named` for SGLang's `update_weights_from_tensor` and its load format.

    Views of one storage in shared memory (CPU) or on a GPU become one flat span (format
    "flattened_bucket"; its metadata as plain namespaces, which SGLang's safe unpickler
    accepts); anything else goes tensor by tensor (format None; torch moves a private CPU
    storage to shared memory whole, so a span of one would copy all of it).
    """
    bucket = flatten(named)
    if bucket is not None and bucket.tensor.device.type == "cpu" and not bucket.tensor.is_shared():
        bucket = None
    if bucket is None:
        payload, load_format = list(named), None
    else:
        metadata = [
            types.SimpleNamespace(
                name=e.name,
                shape=torch.Size(e.shape),
                dtype=e.dtype,
                start_idx=e.start,
                end_idx=e.end,
                numel=e.end - e.start,
            )
            for e in bucket.entries
        ]
        payload = {"flattened_tensor": bucket.tensor, "metadata": metadata}
        load_format = "flattened_bucket"
    out = []
    for _ in range(copies):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(payload)
        out.append(buf.getvalue())
    return out, load_format
