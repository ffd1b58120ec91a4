"""Stub of `torchvision.transforms.functional`: `InterpolationMode` and placeholders."""

from torchvision import InterpolationMode, placeholder

__all__ = ["InterpolationMode"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
