"""Stub of `torchvision.io`: `ImageReadMode` and placeholders such as `decode_image`."""

import enum

from torchvision import placeholder


class ImageReadMode(enum.Enum):
    """The names torchvision defines; read at import time by transformers."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
