"""`weight_sync.delta`: a message encoded against the base its receivers hold decodes to the
new bytes bit for bit, in whichever form is smallest, and refuses a base it was not taken on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_async_rl.weight_sync import delta


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _adam_step_bf16(numel: int, lr: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight before and after one real Adam step at `lr` (fp32 master weights, the
    engine's bf16 copy taken from them, as the trainer does)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.nn.Parameter(torch.randn(numel, generator=gen) * 0.02)
    before = master.detach().to(torch.bfloat16)
    optimizer = torch.optim.Adam([master], lr=lr)
    (master * torch.randn(numel, generator=gen)).sum().backward()
    optimizer.step()
    return before, master.detach().to(torch.bfloat16)


def test_an_rl_step_at_lr_1e_6_is_sent_sparse_in_a_few_percent_and_decodes_exactly():
    before, after = _adam_step_bf16(1 << 20, lr=1e-6)
    encoded = delta.encode(_bytes(after), _bytes(before), 2)
    assert encoded.codec == delta.SPARSE and 0 < encoded.changed
    assert encoded.fraction < 0.10, encoded.fraction
    assert torch.equal(delta.decode(encoded, _bytes(before)), _bytes(after))


def test_small_changes_to_most_elements_still_go_sparse_when_smaller():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(1 << 18, generator=gen).to(torch.bfloat16)
    new = base.clone().view(torch.int16)
    new ^= (torch.rand(new.shape, generator=gen) < 0.6).to(torch.int16)  # flip the lowest bit
    encoded = delta.encode(_bytes(new), _bytes(base), 2)
    assert encoded.codec == delta.SPARSE and encoded.fraction < 0.5, encoded.fraction
    assert torch.equal(delta.decode(encoded, _bytes(base)), _bytes(new))


def test_unrelated_bytes_no_base_or_another_length_go_full():
    gen = torch.Generator().manual_seed(2)
    new = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    other = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    for base in (other, None, other[:100]):
        encoded = delta.encode(new, base, 4)
        assert encoded.codec == delta.FULL and encoded.fraction == 1.0
        assert torch.equal(delta.decode(encoded, base), new)


def test_changes_further_apart_than_a_gap_can_say_are_bridged():
    base = torch.zeros(600_000, dtype=torch.int16)
    new = base.clone()
    new[[3, 200_000, 599_999]] = torch.tensor([1, -7, 300], dtype=torch.int16)
    encoded = delta.encode(_bytes(new), _bytes(base), 2)
    assert encoded.codec == delta.SPARSE and encoded.changed == 3
    assert torch.equal(delta.decode(encoded, _bytes(base)), _bytes(new))


def test_elements_compare_by_their_bits_nan_and_signed_zero_included():
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 64, dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0  # equal as floats, other bits
    new[5] = float("nan")  # NaN in both: unchanged bits
    encoded = delta.encode(_bytes(new), _bytes(base), 4)
    assert encoded.codec == delta.SPARSE and encoded.changed == 1
    assert torch.equal(delta.decode(encoded, _bytes(base)), _bytes(new))


def test_a_message_cut_inside_an_element_is_compared_byte_by_byte():
    base = torch.arange(1001, dtype=torch.uint8)
    new = base.clone()
    new[7] += 1
    encoded = delta.encode(new, base, 2)
    assert encoded.width == 1 and encoded.codec == delta.SPARSE and encoded.changed == 1
    assert torch.equal(delta.decode(encoded, base), new)


def test_nothing_changed_is_an_empty_sparse_delta():
    base = _bytes(torch.randn(512))
    encoded = delta.encode(base.clone(), base, 4)
    assert encoded.codec == delta.SPARSE and encoded.changed == 0 and encoded.fraction < 0.02
    assert torch.equal(delta.decode(encoded, base), base)


def test_decoding_needs_the_base_the_delta_was_taken_on():
    before, after = _adam_step_bf16(4096, lr=1e-6)
    encoded = delta.encode(_bytes(after), _bytes(before), 2)
    with pytest.raises(ValueError, match=r"needs the base it was taken against; this receiver "
                                         r"holds None bytes"):  # fmt: skip
        delta.decode(encoded, None)
    with pytest.raises(ValueError, match="holds 10 bytes"):
        delta.decode(encoded, _bytes(before)[:10])
    cut = dataclasses.replace(encoded, payload=encoded.payload[:-1])
    with pytest.raises(ValueError, match="a sparse delta does not decompress"):
        delta.decode(cut, _bytes(before))


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="new: a contiguous 1-D uint8 tensor is needed"):
        delta.encode(torch.zeros(4), None, 4)
    with pytest.raises(ValueError, match="unknown delta codec 'lz9'"):
        delta.decode(delta.Encoded("lz9", torch.zeros(0, dtype=torch.uint8), 0, 1), None)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_comparing_by_words_finds_exactly_the_changed_elements_and_updates_the_base(width):
    """Lengths that are whole 8-byte words are compared by words and split into elements; the
    others element by element: both give each changed element once, in order, and leave the
    base equal to the new bytes."""
    gen = torch.Generator().manual_seed(width)
    for size in (8 * 3000, 8 * 3000 + width):
        base = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        new = base.clone()
        elements = new.view(delta._INT[width])
        hit = torch.randperm(elements.numel(), generator=gen)[:200]
        elements[hit] ^= 1 << 3  # ~one element of a word: the words' other lanes unchanged
        elements[:4] ^= 1  # neighbours within one word
        expected = torch.unique(torch.cat([hit, torch.arange(4)]))
        kept = base.clone()
        positions, changes = delta._changes(new, kept, width, update_base=True)
        assert torch.equal(positions, expected)
        assert torch.equal(changes, (elements ^ base.view(delta._INT[width]))[expected])
        assert torch.equal(kept, new)
        encoded = delta.encode(new, base, width)
        assert encoded.codec == delta.SPARSE and encoded.changed == expected.numel()
        assert torch.equal(delta.decode(encoded, base), new)
