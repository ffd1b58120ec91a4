"""Where tensors live at a rank's boundaries: one helper for each crossing.

Owned here:
- `to_device(obj, device)`: everything that enters a model (a batch, a micro-batch, the
  loss's inputs) goes to the role's device through this one function.
- `host_bytes(obj)` and the object collectives `all_gather_object`, `gather_object`,
  `broadcast_object_list`: everything that crosses a gloo object collective is pickled with
  its tensors on the CPU first. torch pickles a CUDA tensor with its device index and
  rebuilds it there on the receiver (`torch.load` without `map_location`): on another rank's
  GPU, or on none.
- `bind_thread(device)`: a worker thread that touches CUDA selects the rank's device first;
  the current CUDA device is per thread, and a new thread starts on device 0.

The rank's device itself is decided once, on the main thread, by
`platform.Platform.device()` (from LOCAL_RANK, never `torch.cuda.current_device()`), and is
passed to threads and helpers as an object. A test walks the package and fails on a
`current_device()` call or an object collective outside this module.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist


def _map(obj: Any, fn) -> Any:
    """`obj` with `fn` applied to every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor in `obj` on `device` (the role's device); others unchanged."""
    return _map(obj, lambda t: t if t.device == device else t.to(device, non_blocking=True))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type == "meta":  # shape-only (device-discipline tests): no data to copy
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    return tensor.detach().to("cpu")


def _rebuilt(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _HostPickler(pickle.Pickler):
    """Pickles a tensor that is not on the CPU as its host copy (`_to_host`); everything else
    as `pickle` does. Python calls `reducer_override` only for objects other than the builtin
    containers and scalars, so a step's samples cost what `pickle` costs, not a walk of every
    element in Python (as `to_device` walks): 64 samples of 2048 response tokens, 170-240 ms
    walked then pickled against 6-9 ms, on the learn side's critical path in every step's
    exchange (`benchmarks/object_exchange.py`)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _rebuilt, (_to_host(obj),)
        return NotImplemented


def host_bytes(obj: Any) -> bytes:
    """`obj` pickled with every tensor on the CPU: what crosses an object collective (the
    receiver's `pickle.loads` gives host tensors only)."""
    buf = io.BytesIO()
    _HostPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def all_gather_object(parts: list, obj: Any, group) -> None:
    """`dist.all_gather_object` of `obj`, its tensors on the host (`host_bytes`), over `group`
    (never the default group)."""
    wire: list = [None] * len(parts)
    dist.all_gather_object(wire, host_bytes(obj), group=group)
    parts[:] = [pickle.loads(item) for item in wire]


def gather_object(obj: Any, parts: list | None, dst: int, group) -> None:
    """`dist.gather_object` of `obj`, its tensors on the host, to global rank `dst` over
    `group`; `parts` on `dst` only."""
    wire = None if parts is None else [None] * len(parts)
    dist.gather_object(host_bytes(obj), wire, dst=dst, group=group)
    if parts is not None:
        parts[:] = [pickle.loads(item) for item in wire]


def broadcast_object_list(box: list, src: int, group) -> None:
    """`dist.broadcast_object_list` of `box` over `group`: every rank, `src` too, ends with
    `box` rebuilt from what was sent (its tensors on the host)."""
    if dist.get_rank() == src:
        wire = [host_bytes(item) for item in box]
    else:
        wire = [None] * len(box)
    dist.broadcast_object_list(wire, src=src, group=group)
    box[:] = [pickle.loads(item) for item in wire]


def bind_thread(device: torch.device) -> None:
    """Select `device` as this thread's CUDA device (no-op off CUDA); call first in a thread."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
