"""--use-tp-pp-dp-mapping: a Megatron role's rank order, in the layout, its groups and the reshard.

Contract: with the flag, a role's ranks follow Megatron-LM's order 'tp-cp-ep-pp-dp' (its
`initialize.py` with the flag), without it 'tp-cp-ep-dp-pp'. For several shapes (tp, cp, ep, etp,
pp, dp) and both orders: every rank's coordinates from `RoleGrid.dense_rank` / `expert_rank` /
`dense_coords` are those megatron-core's own `RankGenerator` gives (dense: ep 1; expert: tp is
etp, dp is the expert data-parallel size, cp 1, as `initialize_model_parallel` builds them), and
the `HyperCommGrid`s `distributed.groups` builds every role group from enumerate the same groups
as `RankGenerator` for each group the role collection makes; the reshard plan's senders are the
(tp, cp, dp) = 0 rank of each stage (and EP rank), their pipeline stage is the one
`RankGenerator` gives, and each gathers from its stage's TP group. The rule megatron-core asserts
(pp before dp with pp > 1: the attention and MoE data-parallel sizes agree, etp*ep = tp*cp) is a
`ConfigError` naming the flag. No process group (HyperCommGrid reads WORLD_SIZE); nothing faked.
"""

from __future__ import annotations

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron import parse
from megatron_async_rl.distributed.layout import Parallelism, RoleGrid, plan_layout
from megatron_async_rl.models.dims import ModelDims
from megatron_async_rl.recipe.schema import RoleGroupSpec
from megatron_async_rl.weight_sync.plan import build_plan

OFFSET = 2
MEGATRON_LM_ORDERS = {False: "tp-cp-ep-dp-pp", True: "tp-cp-ep-pp-dp"}
"""Megatron-LM core_v0.16.1 `initialize.py`: the order without and with the flag."""
SHAPES = [  # tp, cp, ep, etp, pp, dp
    (2, 1, 1, 2, 2, 2),
    (1, 1, 1, 1, 2, 4),
    (2, 2, 1, 4, 2, 2),
    (2, 1, 2, 1, 2, 2),
    (1, 2, 2, 1, 3, 2),
    (2, 1, 2, 2, 1, 4),
    (1, 1, 4, 1, 1, 4),
]
DENSE_GROUPS = ("tp", "cp", "dp", "pp", "tp-cp", "tp-pp", "dp-cp", "tp-cp-dp", "tp-cp-dp-pp")
EXPERT_GROUPS = ("tp", "ep", "dp", "tp-ep", "tp-ep-pp")


def _grid(shape, flag: bool) -> RoleGrid:
    tp, cp, ep, etp, pp, dp = shape
    args = parse.parse_megatron_flags(["--use-tp-pp-dp-mapping"] if flag else [])
    par = Parallelism.from_megatron_args({
        **args, "tensor_model_parallel_size": tp, "context_parallel_size": cp,
        "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
        "pipeline_model_parallel_size": pp,
    })  # fmt: skip
    return RoleGrid(OFFSET, tp, pp, dp, cp, ep, etp, par.order)


def _generators(grid: RoleGrid, flag: bool):
    from megatron.core.parallel_state import RankGenerator

    order = MEGATRON_LM_ORDERS[flag]
    dense = RankGenerator(grid.tp, 1, grid.dp, grid.pp, grid.cp, order, rank_offset=grid.offset)
    expert = RankGenerator(grid.etp, grid.ep, grid.expt_dp, grid.pp, 1, order, grid.offset)
    return dense, expert


def _coords(generator, tokens) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for token in tokens:
        for group in generator.get_ranks(token):
            for index, rank in enumerate(group):
                out.setdefault(rank, {})[token] = index
    return out


def _groups(enumeration) -> set[tuple[int, ...]]:
    return {tuple(sorted(group)) for group in enumeration}  # torch sorts a group's ranks


@pytest.mark.parametrize("flag", [False, True], ids=["default", "tp_pp_dp"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tp{}cp{}ep{}etp{}pp{}dp{}".format(*s))
def test_rank_mapping_matches_megatron_core(shape, flag, monkeypatch):
    from megatron_async_rl.distributed.groups import hyper_comm_grids

    grid = _grid(shape, flag)
    dense_gen, expert_gen = _generators(grid, flag)
    dense = _coords(dense_gen, ("tp", "cp", "dp", "pp"))
    expert = _coords(expert_gen, ("tp", "ep", "dp", "pp"))
    assert sorted(dense) == sorted(expert) == list(grid.ranks)
    for rank in grid.ranks:
        d, e = dense[rank], expert[rank]
        assert grid.dense_rank(tp=d["tp"], cp=d["cp"], dp=d["dp"], pp=d["pp"]) == rank
        assert grid.dense_coords(rank) == d
        assert grid.expert_rank(etp=e["tp"], ep=e["ep"], expt_dp=e["dp"], pp=e["pp"]) == rank
        assert e["pp"] == d["pp"]
    monkeypatch.setenv("WORLD_SIZE", str(grid.offset + grid.size))
    dense_grid, expert_grid = hyper_comm_grids(grid)
    for token in DENSE_GROUPS:
        dims = token.split("-")
        assert _groups(dense_grid.get_rank_enum(dims)) == _groups(dense_gen.get_ranks(token))
    for token in EXPERT_GROUPS:
        dims = token.split("-")
        assert _groups(expert_grid.get_rank_enum(dims)) == _groups(expert_gen.get_ranks(token))
    stage_senders = {grid.dense_rank(pp=p) for p in range(grid.pp)}
    assert stage_senders == {r for r in grid.ranks if dense[r]["tp"] == dense[r]["dp"] == 0
                             and dense[r]["cp"] == 0}  # fmt: skip
    assert stage_senders <= set(grid.sender_ranks())


def test_the_two_orders_differ_where_both_pp_and_dp_exceed_one():
    default, flagged = _grid((1, 1, 1, 1, 2, 2), False), _grid((1, 1, 1, 1, 2, 2), True)
    assert [default.dense_coords(r)["pp"] for r in default.ranks] == [0, 0, 1, 1]
    assert [flagged.dense_coords(r)["pp"] for r in flagged.ranks] == [0, 1, 0, 1]
    assert default.sender_ranks() == (OFFSET, OFFSET + 2)
    assert flagged.sender_ranks() == (OFFSET, OFFSET + 1)
    layout = plan_layout(4, [RoleGroupSpec(["train"], num_ranks=4)], {"train": flagged.parallelism})
    assert "train: ranks in order tp-cp-ep-pp-dp" in layout.describe()


@pytest.mark.parametrize("shape", [(2, 1, 1, 2, 2, 2), (2, 1, 2, 1, 2, 2)], ids=["dense", "moe"])
def test_reshard_senders_follow_the_order(shape):
    grid = _grid(shape, True)
    dense_gen, expert_gen = _generators(grid, True)
    pp_of = {r: c["pp"] for r, c in _coords(dense_gen, ("pp",)).items()}
    tp_groups = _groups(dense_gen.get_ranks("tp")) | _groups(expert_gen.get_ranks("tp"))
    moe = grid.ep > 1
    dims = ModelDims(
        num_layers=4, ffn_hidden_size=96, vocab_size=100, padded_vocab_size=128,
        hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
        tied_embeddings=False, add_qkv_bias=False, qk_layernorm=False,
        num_experts=4 if moe else None, moe_ffn_hidden_size=32 if moe else None,
    )  # fmt: skip
    plan = build_plan(grid, dims, "float32", 24_000, 9_000)
    assert tuple(s.rank for s in plan.senders) == grid.sender_ranks()
    for sender in plan.senders:
        assert sender.pp_rank == pp_of[sender.rank]
        stage = dims.stage_layers(sender.pp_rank, grid.pp)
        for gather in (g for b in sender.buckets for m in b.messages for g in m.gathers):
            assert gather.ranks[0] == sender.rank
            if len(gather.ranks) > 1:
                assert tuple(sorted(gather.ranks)) in tp_groups
            if gather.param.startswith("decoder.layers."):
                assert int(gather.param.split(".")[2]) in stage


def test_rule_megatron_core_asserts_is_a_config_error():
    args = {"use_tp_pp_dp_mapping": True, "tensor_model_parallel_size": 2,
            "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2,
            "pipeline_model_parallel_size": 2}  # fmt: skip
    groups = [RoleGroupSpec(["train"], num_ranks=8)]
    with pytest.raises(
        ConfigError,
        match=r"roles\.train\.megatron\.use_tp_pp_dp_mapping = True: the rank order "
        r"tp-cp-ep-pp-dp with pipeline_model_parallel_size 2 > 1 needs the expert grid's "
        r"etp\*ep = 2\*2 to equal tp\*cp = 2\*1 .*hint: set --expert-tensor-parallel-size",
    ):
        plan_layout(8, groups, {"train": Parallelism.from_megatron_args(args)})
    # the same sizes in the default order, or with one stage, are fine (as in megatron-core)
    plan_layout(8, groups, {"train": Parallelism.from_megatron_args({**args,
                "use_tp_pp_dp_mapping": False})})  # fmt: skip
    plan_layout(8, groups, {"train": Parallelism.from_megatron_args({**args,
                "pipeline_model_parallel_size": 1})})  # fmt: skip
    with pytest.raises(ValueError, match=r"etp\*ep=4 must equal tp\*cp=2"):
        RoleGrid(0, tp=2, pp=2, dp=2, ep=2, etp=2, order="tp-cp-ep-pp-dp")
    with pytest.raises(ValueError, match="rank order 'tp-dp-pp' is not one of"):
        Parallelism(1, 1, order="tp-dp-pp")
