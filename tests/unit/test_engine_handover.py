"""Tensors handed to an engine as one span of their shared storage, pickled by their owner
(`engines.sglang.handover`)."""

from __future__ import annotations

import torch

from megatron_async_rl.engines.sglang import handover
from megatron_async_rl.weight_sync import buffers


def _arena():
    specs = [
        ("a.weight", (3, 5), torch.float32),
        ("b.bias", (7,), torch.bfloat16),
        ("c.weight", (2, 2, 4), torch.float32),
    ]
    views, _ = buffers.shared_arena(specs)
    gen = torch.Generator().manual_seed(0)
    for tensor in views.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    return views


def test_views_of_one_buffer_become_one_span_and_come_back_equal():
    views = _arena()
    named = [(n, views[n]) for n in ("c.weight", "a.weight", "b.bias")]  # any order
    bucket = handover.flatten(named)
    assert bucket is not None and bucket.tensor.dtype == torch.uint8
    assert bucket.tensor.is_shared()
    lowest = min(t.data_ptr() for _, t in named)
    assert bucket.tensor.data_ptr() == lowest
    back = bucket.tensors()
    assert [n for n, _ in back] == [n for n, _ in named]
    for (name, sent), (_, got) in zip(named, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert got.data_ptr() == sent.data_ptr(), name  # views, not copies
        assert torch.equal(got, sent), name


def test_span_covers_only_from_first_to_last_byte():
    buf = torch.zeros(1000, dtype=torch.uint8)
    a = buf[100:140].view(torch.float32)
    b = buf[200:208].view(torch.float32)
    bucket = handover.flatten([("a", a), ("b", b)])
    assert bucket.tensor.numel() == 108
    assert [(e.start, e.end) for e in bucket.entries] == [(0, 40), (100, 108)]


def test_tensors_that_do_not_share_a_storage_or_are_strided_are_not_flattened():
    views = _arena()
    assert handover.flatten([]) is None
    assert handover.flatten([("a", views["a.weight"]), ("x", torch.ones(3))]) is None
    assert handover.flatten([("t", views["a.weight"].t())]) is None


def _load(payload: bytes):
    """What a scheduler does with its payload (SGLang deserializes with a restricted unpickler
    of the same format; the real round trip is in tests/distributed/test_sglang_engine.py)."""
    from multiprocessing.reduction import ForkingPickler

    return ForkingPickler.loads(payload)


def test_serialize_sends_views_of_a_shared_buffer_as_one_flat_bucket_per_rank():
    views = _arena()
    named = list(views.items())
    payloads, load_format = handover.serialize(named, copies=2)
    assert load_format == "flattened_bucket" and len(payloads) == 2
    for payload in payloads:  # each TP rank opens its own handle
        data = _load(payload)
        flat = data["flattened_tensor"]
        assert flat.is_shared() and flat.dtype == torch.uint8
        for meta, (name, sent) in zip(data["metadata"], named):
            got = flat[meta.start_idx : meta.end_idx].view(meta.dtype).view(meta.shape)
            assert meta.name == name and meta.numel == meta.end_idx - meta.start_idx
            assert torch.equal(got, sent), name


def test_serialize_sends_private_tensors_one_by_one():
    named = [("a", torch.randn(4, 4)), ("b", torch.randn(3))]
    payloads, load_format = handover.serialize(named, copies=1)
    assert load_format is None
    back = _load(payloads[0])
    assert [n for n, _ in back] == ["a", "b"]
    assert all(torch.equal(got, sent) for (_, got), (_, sent) in zip(back, named))
