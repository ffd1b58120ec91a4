"""Contract of `weight_sync.buffers` and the staging side of `weight_sync.sinks`, no process group.

The checksum catches a flipped byte; packing from strided views (q/k/v of a fused QKV, as the
executor stages them with `megatron_param_to_hf(copy=False)`) writes the same bytes as packing
owned copies; a `BufferPool` hands back the same memory from one sync to the next (shared
memory when asked) and replaces a buffer only when it must; `StagingSink` puts every tensor of a
plan into one shared-memory arena, however the pieces arrive; `load_into_engine` hands an engine
chunks whose CPU tensors all lie in shared memory, as one storage per chunk when they did not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from megatron_async_rl.distributed.layout import RoleGrid
from megatron_async_rl.models.names import megatron_param_to_hf
from megatron_async_rl.weight_sync import buffers, sinks
from megatron_async_rl.weight_sync.plan import build_plan
from tests.harness.weight_sync import DIMS


def _plan(consume_bytes: int):
    layout = RoleGrid(offset=0, tp=1, pp=1, dp=1)
    return build_plan(layout, DIMS, "float32", 4 * consume_bytes, consume_bytes)


def _hf_tensors(plan) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=gen) for n, shape in plan.hf_shapes}


def _messages(plan):
    return [m for s in plan.senders for b in s.buckets for m in b.messages]


def test_checksum_changes_with_any_flipped_byte():
    payload = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    base = buffers.checksum(payload)
    assert 0 <= base <= buffers.CHECKSUM_MASK
    for index in (0, 1, 2047, 16383):
        flipped = payload.clone()
        flipped[index] ^= 1
        assert buffers.checksum(flipped) != base, index


def test_packing_strided_views_writes_the_bytes_of_owned_copies():
    qkv = torch.randn(2 * (2 + 2) * 16, 64)  # groups x (2 q heads + k + v) x head dim, hidden
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    views = dict(megatron_param_to_hf(name, qkv, DIMS, copy=False))
    owned = dict(megatron_param_to_hf(name, qkv, DIMS))
    assert not views["model.layers.0.self_attn.q_proj.weight"].is_contiguous()
    plan = _plan(consume_bytes=2**20)
    message = next(m for m in _messages(plan) if any(p.hf_name in views for p in m.pieces))
    staged = {**_hf_tensors(plan)}
    out = []
    for source in (views, owned):
        buf = torch.zeros(message.wire_bytes, dtype=torch.uint8)
        buffers.pack(buf, message, {**staged, **source}, torch.float32, version=1, sender=0, seq=0)
        out.append(buf)
    assert torch.equal(out[0], out[1])
    got = dict(buffers.unpack(out[0], message, torch.float32))
    for piece, values in got.items():
        if piece.hf_name in owned:
            assert torch.equal(values, owned[piece.hf_name].reshape(-1)[piece.start : piece.stop])


def test_buffer_pool_reuses_memory_and_replaces_only_when_it_must():
    pool = buffers.BufferPool()
    first = pool.get("consume", 0, 1000, shared=True)
    assert first.is_shared() and first.numel() == 1000
    again = pool.get("consume", 0, 800, shared=True)
    assert again.data_ptr() == first.data_ptr() and again.numel() == 800
    assert pool.get("consume", 1, 1000, shared=True).data_ptr() != first.data_ptr()
    assert pool.held_bytes == 2000
    bigger = pool.get("consume", 0, 4000, shared=True)
    assert bigger.numel() == 4000 and pool.held_bytes == 5000
    private = pool.get("consume", 0, 100, shared=False)
    assert not private.is_shared() and pool.held_bytes == 1000 + 100


def test_staging_sink_fills_one_shared_arena_from_split_pieces():
    plan = _plan(consume_bytes=8192)  # small: some tensors arrive in several pieces
    hf = _hf_tensors(plan)
    assert any(not p.is_whole for m in _messages(plan) for p in m.pieces), "nothing split"
    counter = buffers.MemoryCounter()
    sink = sinks.StagingSink(plan, counter, version=3, consume_bytes=8192)
    messages = _messages(plan)
    for seq, message in enumerate(messages):
        buf = torch.zeros(message.wire_bytes, dtype=torch.uint8)
        buffers.pack(buf, message, hf, torch.float32, version=3, sender=0, seq=seq)
        pieces = buffers.unpack(buf, message, torch.float32)
        sink.add(message, pieces, sender=0, seq=seq, last=seq == len(messages) - 1)
    weights = sink.weights
    assert weights.version == 3 and weights.keys() == hf.keys()
    storages = {t.untyped_storage().data_ptr() for t in weights.values()}
    assert len(storages) == 1 and all(t.is_shared() for t in weights.values())
    for name, tensor in hf.items():
        assert torch.equal(weights[name], tensor), name
    assert counter.peak["staging"] >= sum(t.numel() * 4 for t in hf.values())


def test_staging_arena_is_reused_by_the_next_sync_into_the_same_pool():
    plan, pool = _plan(consume_bytes=2**20), buffers.BufferPool()
    a = sinks.StagingSink(plan, buffers.MemoryCounter(), 1, 2**20, pool)
    b = sinks.StagingSink(plan, buffers.MemoryCounter(), 2, 2**20, pool)
    name = plan.hf_shapes[0][0]
    assert a.views[name].data_ptr() == b.views[name].data_ptr()


class _RecordingEngine:
    """Records what `load_into_engine` hands over (the code under test is the chunking)."""

    def __init__(self, reject_call: int | None = None):
        self.calls: list[tuple[list, str, bool]] = []
        self.reject_call, self.ended_complete = reject_call, None

    def weight_version(self) -> str:
        return "v0"

    def begin_weight_update(self) -> None: ...

    def end_weight_update(self, complete: bool = True) -> None:
        self.ended_complete = complete

    def update_weights(self, named, version, flush_cache) -> None:
        if len(self.calls) == self.reject_call:
            raise RuntimeError("shape mismatch, say")
        self.calls.append((named, version, flush_cache))


def test_load_into_engine_hands_over_shared_memory_in_consume_chunks():
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}  # 1 KiB each, private
    engine = _RecordingEngine()
    sinks.load_into_engine(engine, tensors, version=4, consume_bytes=3 * 1024)
    assert [len(named) for named, _, _ in engine.calls] == [3, 3, 2]
    assert [v for _, v, _ in engine.calls] == ["v0", "v0", "v4"]
    assert [f for _, _, f in engine.calls] == [False, False, True]
    assert engine.ended_complete is True
    for named, _, _ in engine.calls:
        assert all(t.is_shared() for _, t in named)
        assert len({t.untyped_storage().data_ptr() for _, t in named}) == 1
        for name, tensor in named:
            assert torch.equal(tensor, tensors[name]), name
    shared = {n: t.clone().share_memory_() for n, t in tensors.items()}
    engine = _RecordingEngine()
    sinks.load_into_engine(engine, shared, version=5, consume_bytes=1 << 20)
    assert all(t is shared[n] for n, t in engine.calls[0][0])


def test_load_into_engine_ends_a_session_it_abandons_incomplete():
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    engine = _RecordingEngine(reject_call=1)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        sinks.load_into_engine(engine, tensors, version=4, consume_bytes=3 * 1024)
    assert len(engine.calls) == 1 and engine.ended_complete is False


def test_an_engine_left_torn_refuses_to_generate_until_an_update_completes():
    from megatron_async_rl.engines.fake import FakeEngine
    from megatron_async_rl.engines.protocol import EngineTornError, GenerateRequest, SamplingParams

    engine = FakeEngine()
    request = [
        GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), rid="r")
    ]
    engine.begin_weight_update()
    engine.end_weight_update(complete=False)  # nothing loaded: nothing changed
    assert engine.generate(request)
    engine.begin_weight_update()
    engine.update_weights([("w", torch.ones(2))], version="v1", flush_cache=False)
    engine.end_weight_update(complete=False)
    with pytest.raises(EngineTornError, match="abandoned after 1 load call"):
        engine.generate(request)
    engine.begin_weight_update()
    engine.update_weights([("w", torch.ones(2))], version="v1")
    engine.end_weight_update()
    assert engine.generate(request)


def test_a_shared_buffer_maps_in_another_process_by_its_handle(tmp_path):
    """`attach` maps /proc/<pid>/fd/<fd> of the owner: here a child process writes into it."""
    import subprocess
    import sys

    owner = buffers.BufferPool()
    buf = owner.get("produce", 0, 4096, shared=True)
    buf.fill_(7)
    handle = owner.share("produce", 0)
    code = (
        "import sys, torch\n"
        "from megatron_async_rl.weight_sync.buffers import BufferPool, SharedHandle\n"
        f"handle = SharedHandle(**{dataclasses.asdict(handle)!r})\n"
        "pool = BufferPool()\n"
        "view = pool.attach(('produce', 0, 0), handle)\n"
        "assert pool.attach(('produce', 0, 0), handle) is view  # kept\n"
        "assert int(view[:4096].sum()) == 7 * 4096 and view.is_shared()\n"
        "view[:16] = 9\n"
        "assert pool.held_bytes == 0  # the owner's memory\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert buf[:16].tolist() == [9] * 16 and int(buf[16:].sum()) == 7 * (4096 - 16)
    with pytest.raises(OSError, match="on host elsewhere"):
        buffers.BufferPool().attach("k", replace(handle, host="elsewhere"))
    other = owner.get("consume", 0, 4096, shared=True)  # another file, another fd
    assert other.is_shared()
    wrong = replace(handle, fd=owner.share("consume", 0).fd)
    with pytest.raises(OSError, match="is not the buffer shared"):
        buffers.BufferPool().attach("k", wrong)


def test_device_checksum_catches_flips_swaps_and_tails(monkeypatch):
    """The GPU checksum, computed here with the same torch ops on the CPU: every flipped byte
    changes it, so do two swapped steps and a changed tail byte; it is the same for the same
    bytes at any alignment."""
    monkeypatch.setattr(buffers, "DEVICE_CHECKSUM_WORDS", 64)  # several steps in 4 KiB
    buffers._checksum_weights.cache_clear()
    try:
        payload = torch.arange(1027, dtype=torch.int32).view(torch.uint8)[:4101]  # 5-byte tail
        base = buffers.device_checksum(payload)
        assert 0 <= base <= buffers.CHECKSUM_MASK
        for index in (0, 7, 511, 512, 4095, 4096, 4100):
            flipped = payload.clone()
            flipped[index] ^= 1
            assert buffers.device_checksum(flipped) != base, index
        swapped = payload.clone()
        swapped[:512], swapped[512:1024] = payload[512:1024], payload[:512]
        assert buffers.device_checksum(swapped) != base
        shifted = torch.zeros(4101 + 3, dtype=torch.uint8)
        shifted[3:] = payload
        assert buffers.device_checksum(shifted[3:]) == base  # a misaligned start
    finally:
        buffers._checksum_weights.cache_clear()


def test_pinning_needs_cuda_in_use():
    """Without CUDA in use (this machine, or a GPU node whose platform is the CPU: the compat
    layer hides CUDA) a pinned request gives a plain shared buffer; `tests/gpu` pins for real."""
    pool = buffers.BufferPool()
    views, _ = buffers.shared_arena([("w", (8, 8), torch.float32)], pool, pinned=True)
    assert views["w"].is_shared() and not pool.is_pinned("staging", 0)
