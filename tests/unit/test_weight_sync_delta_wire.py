"""Delta messages on the wire and the bases both ends keep (`weight_sync.delta_wire`).

Contracts checked (pure, in process; the collective twin is
tests/distributed/test_weight_sync_delta.py):
- a packed message goes through `encode_message` and comes out of `decode_into` with the same
  header and payload bytes, whole (no base) or as a delta against the base, which is smaller;
  the sender's kept copy is its own tensor (the slot is reused), and with a base, both ends
  bring their base up to the new payload in place;
- what cannot be decoded is a ValueError: an unknown codec, a delta from a sender that agreed to
  send whole messages, a delta without its base, bytes that do not decompress;
- `DeltaBases`: a sender's version is held only once `complete`d (keeping a message of a new
  version forgets the old one), a failed sync or another plan drops it, and `proposal` asks for
  a whole sync every `full_every` versions.
"""

import pytest
import torch

from megatron_async_rl.weight_sync.delta_wire import (
    CODEC_IDS,
    DELTA_HEADER_BYTES,
    DeltaBases,
    decode_into,
    encode_message,
    read_length,
)
from megatron_async_rl.weight_sync.plan import HEADER_BYTES


def _message(values: torch.Tensor) -> torch.Tensor:
    header = torch.tensor([7, 12345, 0, 3], dtype=torch.int64).view(torch.uint8)
    return torch.cat([header, values.view(torch.uint8)])


def _round_trip(view, base, deltas=True):
    """Sender and receiver each hold their own copy of `base` (both updated in place)."""
    sender_base = base.clone() if base is not None else None
    head, body, kept = encode_message(view, sender_base, 2)
    codec, length = read_length(head)
    assert head.numel() == DELTA_HEADER_BYTES and length == body.numel()
    out = torch.empty_like(view)
    payload = decode_into(out, head, codec, body, base, deltas, 2)
    return out, payload, kept, codec, body


def test_whole_and_delta_messages_come_back_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(8192, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[::97] = (new[::97].float() * 1.02).to(torch.bfloat16)
    view = _message(new)
    out, payload, kept, codec, body = _round_trip(view, None)
    assert codec == CODEC_IDS["full"] and torch.equal(out, view)
    assert torch.equal(payload, view[HEADER_BYTES:]) and kept.data_ptr() != view.data_ptr()
    base = _message(old)[HEADER_BYTES:].clone()
    out, payload, kept, codec, body = _round_trip(view, base)
    assert codec == CODEC_IDS["sparse"] and torch.equal(out, view)
    assert body.numel() < 0.1 * payload.numel()
    # both bases now hold the new payload, updated where it changed (no fresh copy)
    assert torch.equal(kept, view[HEADER_BYTES:]) and payload.data_ptr() == base.data_ptr()
    # a message sent whole while its sender holds an old base: the base is overwritten in place
    spare = _message(old)[HEADER_BYTES:].clone()
    head, body, kept = encode_message(view, None, 2, spare=spare)
    assert read_length(head)[0] == CODEC_IDS["full"] and torch.equal(body, view[HEADER_BYTES:])
    assert kept.data_ptr() == spare.data_ptr() and torch.equal(spare, view[HEADER_BYTES:])


def test_what_cannot_be_decoded_is_refused():
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4096, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[::50] = 0.5
    view, base = _message(new), _message(old)[HEADER_BYTES:].clone()
    head, body, _ = encode_message(view, base.clone(), 2)
    codec, _ = read_length(head)
    out = torch.empty_like(view)
    with pytest.raises(ValueError, match="unknown codec id 9"):
        decode_into(out, head, 9, body, base, True, 2)
    with pytest.raises(ValueError, match="agreed to send whole ones"):
        decode_into(out, head, codec, body, base, False, 2)
    with pytest.raises(ValueError, match="needs the base it was taken against"):
        decode_into(out, head, codec, body, None, True, 2)
    broken = body.clone()
    broken[:32] ^= 0x5A
    with pytest.raises(ValueError, match="does not decompress|sparse delta"):
        decode_into(out, head, codec, broken, base, True, 2)
    bad = head.clone()
    bad[HEADER_BYTES + 8 :].view(torch.int64)[0] = -1
    with pytest.raises(ValueError, match="announces -1 bytes"):
        read_length(bad)


def test_bases_hold_a_version_only_when_complete():
    bases = DeltaBases(full_every=3)
    bases.use_plan("plan-a")
    assert bases.held(0) is None and bases.proposal(0) is None
    bases.keep(0, 0, torch.zeros(4, dtype=torch.uint8))
    bases.keep(0, 1, torch.ones(4, dtype=torch.uint8))
    assert bases.held(0) is None  # not complete yet
    bases.finish(1, {0: False}, clean=True)
    assert bases.held(0) == 1 and bases.proposal(0) == 1 and bases.nbytes == 8
    bases.keep(0, 0, torch.zeros(4, dtype=torch.uint8))
    assert bases.held(0) is None  # half of version 2 kept: no version held
    bases.finish(2, {0: True}, clean=True)
    assert bases.proposal(0) == 2
    bases.finish(3, {0: True}, clean=True)
    assert bases.proposal(0) is None  # two deltas in a row: the third version is whole
    bases.finish(4, {0: False}, clean=True)
    assert bases.proposal(0) == 4
    bases.finish(5, {0: True, 1: False}, clean=False)  # a failed sync drops what it kept
    assert bases.held(0) is None and bases.held(1) is None and bases.nbytes == 0
    bases.keep(2, 0, torch.zeros(4, dtype=torch.uint8))
    bases.finish(6, {2: False}, clean=True)
    bases.use_plan("plan-a")
    assert bases.held(2) == 6
    bases.use_plan("plan-b")  # another plan: other messages
    assert bases.held(2) is None and bases.nbytes == 0


def test_deltas_that_failed_are_counted_over_the_attempts_of_a_version(monkeypatch):
    """A version whose delta failed somewhere is sent again (whole): the row of the version
    counts the failed deltas of every attempt, not only the last one's (its own zero)."""
    import types

    from megatron_async_rl.weight_sync import broadcast
    from megatron_async_rl.weight_sync.config import WeightSyncConfig

    outcomes = iter([
        ({"weight_sync/delta_fallbacks": 2.0}, ["global rank 2: did not decode"]),
        ({"weight_sync/delta_fallbacks": 0.0, "weight_sync/delta_fraction": 1.0}, []),
    ])  # fmt: skip

    def attempt(*args, **kwargs):
        metrics, errors = next(outcomes)
        return "sink", dict(metrics), errors, True, False

    monkeypatch.setattr(broadcast, "_attempt", attempt)
    groups = types.SimpleNamespace(rank=0, weight_receivers=[1, 2], weight_senders={0: None})
    sink, metrics = broadcast._reshard(
        groups, {"train": object()}, 5, WeightSyncConfig(delta=True, max_attempts=2),
        None, None, None,
    )  # fmt: skip
    assert sink == "sink"
    assert metrics["weight_sync/attempts"] == 2 and metrics["weight_sync/delta_fallbacks"] == 2.0
