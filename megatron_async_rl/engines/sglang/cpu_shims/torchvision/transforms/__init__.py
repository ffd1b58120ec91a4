"""Stub of `torchvision.transforms`: `InterpolationMode`, submodules, placeholders."""

from torchvision import InterpolationMode, placeholder
from torchvision.transforms import functional, v2

__all__ = ["InterpolationMode", "functional", "v2"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
