"""Where tensors live at a rank's boundaries: one helper for each crossing.

Owned here:
- `to_device(obj, device)`: everything that enters a model (a batch, a micro-batch, the
  loss's inputs) goes to the role's device through this one function.
- `host_copy(obj)` and the object collectives `all_gather_object`, `gather_object`,
  `broadcast_object_list`: everything that crosses a gloo object collective goes to the CPU
  first. torch pickles a CUDA tensor with its device index and rebuilds it there on the
  receiver (`torch.load` without `map_location`): on another rank's GPU, or on none.
- `bind_thread(device)`: a worker thread that touches CUDA selects the rank's device first;
  the current CUDA device is per thread, and a new thread starts on device 0.

The rank's device itself is decided once, on the main thread, by
`platform.Platform.device()` (from LOCAL_RANK, never `torch.cuda.current_device()`), and is
passed to threads and helpers as an object. A test walks the package and fails on a
`current_device()` call or an object collective outside this module.
"""

from __future__ import annotations

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


def host_copy(obj: Any) -> Any:
    """Every tensor in `obj` on the CPU: what may cross an object collective."""
    return _map(obj, _to_host)


def all_gather_object(parts: list, obj: Any, group) -> None:
    """`dist.all_gather_object` of `host_copy(obj)` over `group` (never the default group)."""
    dist.all_gather_object(parts, host_copy(obj), group=group)


def gather_object(obj: Any, parts: list | None, dst: int, group) -> None:
    """`dist.gather_object` of `host_copy(obj)` to global rank `dst` over `group`."""
    dist.gather_object(host_copy(obj), parts, dst=dst, group=group)


def broadcast_object_list(box: list, src: int, group) -> None:
    """`dist.broadcast_object_list` of `box` (host copies on `src`) over `group`."""
    if dist.get_rank() == src:
        box[:] = [host_copy(item) for item in box]
    dist.broadcast_object_list(box, src=src, group=group)


def bind_thread(device: torch.device) -> None:
    """Select `device` as this thread's CUDA device (no-op off CUDA); call first in a thread."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
