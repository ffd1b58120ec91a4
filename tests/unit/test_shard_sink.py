"""`weight_sync.shard_sink.ShardSink`: pieces of HF tensors straight into a rank's slices.

Contracts checked, for a dense and a MoE tiny model over TP, PP and EP layouts, with every HF
tensor cut into uneven flat pieces sent in model order: the rank's parameters end equal to
`shards.stage_state_dict_from_hf` (what loading from disk gives); pieces of tensors the rank
does not hold are dropped (never staged); peak staging stays below the whole model's bytes and
nothing stays staged at the end; a sync that ends with a parameter unwritten names it; a
module that does not match the stage is refused with the names. The module is a plain holder
of tensors; `tests/distributed/test_reshard_sglang.py` runs the sink into real Megatron models.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_async_rl.models.dims import ModelDims
from megatron_async_rl.models.hf_checkpoint import HFTensorReader, read_hf_config
from megatron_async_rl.models.hf_config import megatron_args_from_hf
from megatron_async_rl.models.names import hf_names_for
from megatron_async_rl.models.shards import stage_entries, stage_state_dict_from_hf
from megatron_async_rl.models.tiny import write_tiny_model
from megatron_async_rl.weight_sync import buffers
from megatron_async_rl.weight_sync.plan import Piece
from megatron_async_rl.weight_sync.shard_sink import ShardSink


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family in ("llama", "qwen3_moe"):
        path = write_tiny_model(tmp_path_factory.mktemp(family), family, seed=5)
        dims = ModelDims.from_megatron_args(megatron_args_from_hf(read_hf_config(path)))
        reader = HFTensorReader(path)
        out[family] = (dims, {k: reader.read(k) for k in reader.keys()}, reader)
    return out


class Holder:
    """Stands in for a Megatron module: `state_dict()` gives its tensors by local name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self):
        return dict(self.tensors)


def _pieces(hf: dict[str, torch.Tensor], cuts: int):
    """Every HF tensor in `cuts` uneven flat pieces (a whole one when it is small)."""
    for name, tensor in hf.items():
        flat, n = tensor.reshape(-1), tensor.numel()
        bounds = sorted({0, n, *(n * k // (cuts + 1) + k for k in range(1, cuts + 1) if n > 64)})
        for start, stop in zip(bounds, bounds[1:]):
            piece = Piece(name, tuple(tensor.shape), start, stop, 0, name)
            yield piece, flat[start:stop]


RANKS = [dict(tp_rank=1, tp_size=2), dict(pp_rank=1, pp_size=2),
         dict(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2),
         dict(ep_rank=1, ep_size=2), dict(ep_rank=0, ep_size=2, tp_rank=1, tp_size=2, etp_size=1,
                                          etp_rank=0)]  # fmt: skip
CASES = [
    (f, r) for f in ("llama", "qwen3_moe") for r in RANKS if f == "qwen3_moe" or "ep_size" not in r
]


@pytest.mark.parametrize(("family", "ranks"), CASES, ids=str)
def test_rank_gets_the_slices_loading_from_disk_gives(models, family, ranks):
    dims, hf, reader = models[family]
    expected = stage_state_dict_from_hf(reader.read, dims, reader.read_range, **ranks)
    holder = Holder({k: torch.zeros_like(v) for k, v in expected.items()})
    counter = buffers.MemoryCounter()
    sink = ShardSink(holder, dims, ranks, counter, torch.float32, 3)
    seen = set()
    for piece, values in _pieces(hf, cuts=3):
        sink.add(None, [(piece, values)], sender=0, seq=0, last=False)
        seen |= set(sink.buffers)
    assert sink.finish(complete=True) is None
    for name, tensor in expected.items():
        assert torch.equal(holder.tensors[name], tensor), name
    needed = {h for e in stage_entries(dims, **ranks) for h in hf_names_for(e.source, dims)}
    assert seen <= needed  # others' pieces were never staged
    if ranks.get("pp_size", 1) > 1 or ranks.get("ep_size", 1) > 1:
        assert len(needed) < len(hf)
    whole = sum(t.numel() * t.element_size() for t in hf.values())
    assert 0 < counter.peak["staging"] < whole / 2
    assert counter.live["staging"] == 0 and not sink.buffers


def test_an_unwritten_parameter_is_named(models):
    dims, hf, reader = models["llama"]
    expected = stage_state_dict_from_hf(reader.read, dims)
    sink = ShardSink(Holder(dict(expected)), dims, {}, buffers.MemoryCounter(), torch.float32, 3)
    for piece, values in _pieces(hf, cuts=2):
        if piece.hf_name != "model.norm.weight":
            sink.add(None, [(piece, values)], sender=0, seq=0, last=False)
    error = sink.finish(complete=True)
    assert "1 parameter(s) never written" in error and "decoder.final_layernorm.weight" in error
    assert sink.finish(complete=False) is None  # an incomplete run reports its own error


def test_a_module_that_is_not_the_stage_is_refused(models):
    dims, _, reader = models["llama"]
    expected = stage_state_dict_from_hf(reader.read, dims, pp_rank=0, pp_size=2)
    with pytest.raises(ValueError, match="have no source") as info:
        ShardSink(Holder(expected), dims, {"pp_rank": 1, "pp_size": 2}, None, torch.float32, 3)
    assert "embedding.word_embeddings.weight" in str(info.value) and "final_layernorm" in str(
        info.value
    )
    assert "global rank 3" in str(info.value)


def test_pieces_of_a_split_tensor_are_staged_once_and_counted(models):
    dims, hf, reader = models["llama"]
    expected = stage_state_dict_from_hf(reader.read, dims, tp_rank=0, tp_size=2)
    counter = buffers.MemoryCounter()
    sink = ShardSink(
        Holder(dict(expected)), dims, dict(tp_rank=0, tp_size=2), counter, torch.float32, 0
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    pieces = [p for p in _pieces({name: hf[name]}, cuts=2)]
    sink.add(None, pieces[:1], sender=0, seq=0, last=False)
    assert counter.live["staging"] == math.prod(hf[name].shape) * 4
