"""Test-suite wiring: skip `gpu` tests without CUDA; keep CPU ranks from oversubscribing."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# One seed for every family: the tests want random norms and biases (see `models.tiny`), not
# distinct seeds, and one directory per (family, overrides) serves the whole session.
TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(family, **overrides)` -> the directory of a tiny HF model (`write_tiny_model`,
    seed `TINY_SEED`), written once per session for each (family, overrides). Read-only: a test
    that writes next to a checkpoint uses its own `tmp_path`."""
    from megatron_async_rl.models.tiny import write_tiny_model

    written = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in written:
            out = tmp_path_factory.mktemp(f"tiny-{family}") / family
            written[key] = write_tiny_model(out, family, seed=TINY_SEED, **overrides)
        return written[key]

    return get
