"""Contract of `weight_sync.plan`: the reshard plan covers the model exactly, within its bounds.

For dense (llama-like GQA, gated MLP; tied and untied, with QKV bias and QK norms; two model
chunks per pipeline rank: virtual pipeline stages) and MoE dims, and train layouts TP1, TP2,
PP2, TP2xPP2, EP2, TP2xEP2 (expert TP 2 and 1), PP2xEP2 at a rank offset: every element of
every HF tensor the engine expects is in exactly one piece of one sender's buckets; messages
and buckets stay within the consume and produce bounds; the plan is deterministic and cached;
with PP>1 or EP>1 no sender sends the whole model. The gather rule is checked element by
element: full HF tensors of unique values are sharded by `models.shards` as each rank holds them
(rank coordinates from megatron-core's own HyperCommGrid, independently of the plan's
formulas), gathered from the plan's contributor ranks, packed and unpacked through
`weight_sync.buffers`, reassembled, and compared exactly. No process group; nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from megatron_async_rl.distributed.layout import RoleGrid
from megatron_async_rl.models.dims import ModelDims
from megatron_async_rl.models.names import (
    hf_names_for,
    hf_to_megatron,
    megatron_param_to_hf,
    stage_param_names,
)
from megatron_async_rl.models.shards import stage_state_dict, unshard
from megatron_async_rl.weight_sync import buffers
from megatron_async_rl.weight_sync.plan import build_plan, check_stage_names, hf_shape

OFFSET = 3
_COMMON = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16)
DIMS = {
    "dense": ModelDims(
        num_layers=4, ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128,
        tied_embeddings=False, add_qkv_bias=False, qk_layernorm=False, **_COMMON,
    ),
    "dense_tied_bias_qknorm": ModelDims(
        num_layers=4, ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128,
        tied_embeddings=True, add_qkv_bias=True, qk_layernorm=True, **_COMMON,
    ),
    "dense_tied_vp2": ModelDims(  # two model chunks per pipeline rank when pp > 1
        num_layers=4, ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128,
        tied_embeddings=True, add_qkv_bias=True, qk_layernorm=True, vp_size=2, **_COMMON,
    ),
    "moe": ModelDims(
        num_layers=2, ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128,
        tied_embeddings=False, add_qkv_bias=False, qk_layernorm=True, num_experts=4,
        moe_ffn_hidden_size=32, **_COMMON,
    ),
    "moe_tied": ModelDims(
        num_layers=2, ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128,
        tied_embeddings=True, add_qkv_bias=False, qk_layernorm=True, num_experts=4,
        moe_ffn_hidden_size=32, **_COMMON,
    ),
}  # fmt: skip
LAYOUTS = {
    "tp1": RoleGrid(OFFSET, tp=1, pp=1, dp=1),
    "tp2": RoleGrid(OFFSET, tp=2, pp=1, dp=1, etp=2),
    "pp2": RoleGrid(OFFSET, tp=1, pp=2, dp=1),
    "tp2_pp2": RoleGrid(OFFSET, tp=2, pp=2, dp=1, etp=2),
    "tp2_dp2": RoleGrid(OFFSET, tp=2, pp=1, dp=2, etp=2),
}
MOE_LAYOUTS = {
    "ep2": RoleGrid(OFFSET, tp=1, pp=1, dp=2, ep=2),
    "tp2_ep2": RoleGrid(OFFSET, tp=2, pp=1, dp=2, ep=2, etp=2),
    "tp2_ep2_etp1": RoleGrid(OFFSET, tp=2, pp=1, dp=1, ep=2, etp=1),
    "pp2_ep2": RoleGrid(OFFSET, tp=1, pp=2, dp=2, ep=2),
}
CASES = [(d, lay) for d in DIMS for lay in LAYOUTS] + [
    (d, lay) for d in DIMS if d.startswith("moe") for lay in MOE_LAYOUTS
]
# Small buckets so that tensors are cut into pieces and senders fill several buckets.
PRODUCE, CONSUME = 24_000, 9_000


def _layout(name: str) -> RoleGrid:
    return {**LAYOUTS, **MOE_LAYOUTS}[name]


def _coordinates(layout: RoleGrid, monkeypatch) -> dict[int, dict[str, int]]:
    """Global rank -> its grid coordinates, from megatron-core's HyperCommGrid enumerations."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", str(layout.offset + layout.size))
    dense = HyperCommGrid(
        [layout.tp, layout.cp, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"], layout.offset
    )
    expert = HyperCommGrid(
        [layout.etp, layout.ep, layout.expt_dp, layout.pp], ["tp", "ep", "dp", "pp"], layout.offset
    )
    coords: dict[int, dict[str, int]] = {
        r: {} for r in range(layout.offset, layout.offset + layout.size)
    }
    for grid, dim, key in [(dense, "tp", "tp_rank"), (dense, "pp", "pp_rank"),
                           (dense, "dp", "dp_rank"), (expert, "tp", "etp_rank"),
                           (expert, "ep", "ep_rank"), (expert, "dp", "edp_rank")]:  # fmt: skip
        for group in grid.get_rank_enum(dim):
            for index, rank in enumerate(group):
                coords[rank][key] = index
    coords["tp_groups"] = [tuple(g) for g in dense.get_rank_enum("tp")]
    coords["etp_groups"] = [tuple(g) for g in expert.get_rank_enum("tp")]
    return coords


def _unique_hf(plan) -> dict[str, torch.Tensor]:
    out, start = {}, 1
    for name, shape in plan.hf_shapes:
        numel = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + numel, dtype=torch.float32).reshape(shape)
        start += numel
    return out


def _plan(dims_name, layout_name, **kw):
    kw = {"produce_bytes": PRODUCE, "consume_bytes": CONSUME, **kw}
    return build_plan(_layout(layout_name), DIMS[dims_name], "float32", **kw)


@pytest.mark.parametrize("dims_name,layout_name", CASES)
def test_every_element_is_in_exactly_one_piece_within_bounds(dims_name, layout_name):
    plan, dims = _plan(dims_name, layout_name), DIMS[dims_name]
    expected = {hf for name in stage_param_names(dims) for hf in hf_names_for(name, dims)}
    shapes = dict(plan.hf_shapes)
    assert shapes.keys() == expected and len(plan.hf_shapes) == len(expected)
    hits = {
        name: torch.zeros(torch.Size(shape).numel(), dtype=torch.int32)
        for name, shape in shapes.items()
    }
    for sender in plan.senders:
        for bucket in sender.buckets:
            assert bucket.nbytes <= PRODUCE
            for message in bucket.messages:
                assert message.wire_bytes <= CONSUME
                end = 0
                for piece in message.pieces:
                    assert piece.shape == shapes[piece.hf_name] and piece.offset >= end
                    end = piece.offset + piece.numel * 4
                    hits[piece.hf_name][piece.start : piece.stop] += 1
                assert end <= message.payload_bytes
    for name, count in hits.items():
        assert torch.all(count == 1), name
    assert sum(len(s.buckets) for s in plan.senders) == len(plan.schedule)


@pytest.mark.parametrize("dims_name,layout_name", CASES)
def test_gather_rule_reassembles_every_tensor_exactly(dims_name, layout_name, monkeypatch):
    plan, dims, layout = _plan(dims_name, layout_name), DIMS[dims_name], _layout(layout_name)
    coords = _coordinates(layout, monkeypatch)
    hf_sd = _unique_hf(plan)
    full = hf_to_megatron(hf_sd, dims)
    held = {}
    for rank in layout_ranks(layout):
        c = coords[rank]
        held[rank] = stage_state_dict(
            full, dims, tp_rank=c["tp_rank"], tp_size=layout.tp, pp_rank=c["pp_rank"],
            pp_size=layout.pp, ep_rank=c["ep_rank"], ep_size=layout.ep,
            etp_rank=c["etp_rank"], etp_size=layout.etp,
        )  # fmt: skip
    counter, pool = buffers.MemoryCounter(), buffers.BufferPool()
    # One split-tensor buffer per sender, reused (as a streaming engine sink does).
    assembler, received = buffers.Assembler(torch.float32, counter, pool=pool), {}
    staged: dict[str, dict[str, torch.Tensor]] = {s.rank: {} for s in plan.senders}
    for sender_index, bucket_index in plan.schedule:
        sender = plan.senders[sender_index]
        bucket = sender.buckets[bucket_index]
        for seq, message in enumerate(bucket.messages):
            for g in message.gathers:  # the parameters this message starts
                assert g.ranks[0] == sender.rank
                groups = coords["etp_groups" if g.group == "expt_tp" else "tp_groups"]
                if g.is_collective:
                    assert g.ranks in groups, (g.param, g.ranks)
                else:
                    size = layout.etp if g.group == "expt_tp" else layout.tp
                    assert g.ranks == (sender.rank,) and (g.spec.partition_dim is None or size == 1)
                shards = [held[r][g.local_name] for r in g.ranks]
                tensor = unshard(shards, g.spec) if g.is_collective else shards[0]
                # Views, as the executor packs them (q/k/v of a fused QKV are strided).
                hf = megatron_param_to_hf(g.param, tensor, dims, copy=False)
                staged[sender.rank].update(hf)
            buf = torch.zeros(message.wire_bytes, dtype=torch.uint8)
            buffers.pack(buf, message, staged[sender.rank], torch.float32, version=7,
                         sender=sender.rank, seq=seq)  # fmt: skip
            for param in message.releases:  # packed for the last time: the sender drops them
                for hf in hf_names_for(param, dims):
                    staged[sender.rank].pop(hf)
            header = buffers.read_header(buf)
            assert header.checksum == buffers.payload_checksum(buf, message)
            assert (header.version, header.sender, header.seq) == (7, sender.rank, seq)
            for piece, values in buffers.unpack(buf, message, torch.float32):
                whole = assembler.add(piece, values, key=sender.rank)
                if whole is not None:
                    received[piece.hf_name] = whole.clone()
                    assembler.release(piece, whole)
    assert not assembler.pending and all(not s for s in staged.values())
    assert received.keys() == hf_sd.keys()
    for name, tensor in hf_sd.items():
        assert torch.equal(received[name], tensor), name
    assert counter.live.get("staging", 0) == 0


def layout_ranks(layout: RoleGrid) -> range:
    return range(layout.offset, layout.offset + layout.size)


@pytest.mark.parametrize("dims_name,layout_name", CASES)
def test_no_sender_holds_the_whole_model_when_split(dims_name, layout_name):
    plan, layout = _plan(dims_name, layout_name), _layout(layout_name)
    model_bytes = sum(torch.Size(shape).numel() * 4 for _, shape in plan.hf_shapes)
    senders = {s.rank for s in plan.senders}
    assert senders <= set(layout.sender_ranks())
    for sender in plan.senders:
        payload = sum(p.numel * 4 for b in sender.buckets for m in b.messages for p in m.pieces)
        if layout.pp > 1 or layout.ep > 1:
            assert payload < model_bytes, sender.rank
    assert len(senders) == layout.pp * (layout.ep if DIMS[dims_name].num_experts else 1)


def test_plan_is_deterministic_and_cached():
    build_plan.cache_clear()
    first = _plan("moe", "tp2_ep2")
    assert _plan("moe", "tp2_ep2") is first
    build_plan.cache_clear()
    again = _plan("moe", "tp2_ep2")
    assert again == first and again is not first
    assert _plan("moe", "tp2_ep2", produce_bytes=PRODUCE * 2) != first


def test_default_buckets_send_each_stage_in_one_bucket():
    plan = build_plan(LAYOUTS["pp2"], DIMS["dense"])
    assert [len(s.buckets) for s in plan.senders] == [1, 1]
    assert [s.pp_rank for s in plan.senders] == [0, 1]


def test_rank_formulas_follow_the_hyper_comm_grid(monkeypatch):
    layout = RoleGrid(OFFSET, tp=2, pp=2, dp=2, ep=2, etp=1)
    coords = _coordinates(layout, monkeypatch)
    for rank in layout_ranks(layout):
        c = coords[rank]
        assert layout.dense_rank(tp=c["tp_rank"], dp=c["dp_rank"], pp=c["pp_rank"]) == rank
        assert layout.expert_rank(c["etp_rank"], c["ep_rank"], c["edp_rank"], c["pp_rank"]) == rank


def test_user_mistakes_are_named():
    with pytest.raises(
        ValueError, match="no HF shape rule for tensor 'model.layers.0.mlp.foo.weight'"
    ):
        hf_shape("model.layers.0.mlp.foo.weight", DIMS["dense"])
    with pytest.raises(ValueError, match="dtype 'int8' is not one of"):
        build_plan(LAYOUTS["tp1"], DIMS["dense"], "int8")
    with pytest.raises(ValueError, match="consume_bytes = 10 must be >= 96"):
        build_plan(LAYOUTS["tp1"], DIMS["dense"], "float32", 1 << 20, 10)
    with pytest.raises(ValueError, match="does not split into etp=1 x ep=2 x pp=2"):
        RoleGrid(0, tp=1, pp=2, dp=1, ep=2)
    plan = _plan("moe", "tp2_ep2")
    with pytest.raises(
        ValueError,
        match="unknown Megatron parameter 'decoder.layers.0.mlp.experts.linear_fc1.weight0'",
    ):
        check_stage_names(plan, OFFSET, ["decoder.layers.0.mlp.experts.linear_fc1.weight0"], 0, 0)
    with pytest.raises(
        ValueError,
        match=r"needs parameter 'decoder.+' from global rank 3, but its model stage has no such",
    ):
        check_stage_names(plan, OFFSET, ["embedding.word_embeddings.weight"], 0, 0)
