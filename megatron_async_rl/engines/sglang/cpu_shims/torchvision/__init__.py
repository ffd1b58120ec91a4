"""Import-only stand-in for `torchvision` on CPU (see ../README.md).

The PyPI torchvision wheels link the CUDA build of torch and fail to import next to the CPU
torch. SGLang and transformers import torchvision while loading configs and processors even for
text-only models, and use nothing from it there. This package lets those imports succeed: it
exposes `transforms`, `transforms.functional`, `transforms.v2`, `transforms.v2.functional` and
`io`, with the `InterpolationMode` enum (read at import time by transformers) and, for any other
name, a placeholder that raises a clear error when called. Image and video models need the real
torchvision and do not run with this shim.
"""

from __future__ import annotations

import enum

__version__ = "0.0.0+megatron_async_rl.cpu_shim"


class InterpolationMode(enum.Enum):
    """The names torchvision defines; transformers maps PIL resampling modes onto them."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def placeholder(module: str, name: str):
    """A class that stands for `module.name` and raises when used."""

    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"{module}.{name}: torchvision is an import stub on CPU (megatron_async_rl "
            "engines/sglang/cpu_shims); image and video inputs need the real torchvision"
        )

    return type(name, (), {"__new__": fail, "__call__": fail, "__module__": module})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
