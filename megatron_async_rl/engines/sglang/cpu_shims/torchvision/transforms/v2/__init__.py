"""Stub of `torchvision.transforms.v2`: the `functional` submodule and placeholders."""

from torchvision import InterpolationMode, placeholder
from torchvision.transforms.v2 import functional

__all__ = ["InterpolationMode", "functional"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
