"""The pure rank layout (`distributed/layout.py`): windows, lookups, Megatron's divisibility rules.

Contract: `plan_layout(world_size, groups, parallelism)` lays `roles.groups` out from rank 0 in
order; counts must sum to the world size, ratios become whole counts (sharing what counts leave);
every Megatron role needs tp*pp*cp | window size and, as megatron-core 0.16's
`initialize_model_parallel` requires, etp*ep*pp | window size (equivalently
(dp*tp*cp) % (ep*etp) == 0, checked here against that formula over a grid of sizes). Engines:
with `engine_tp_size` T the generate window splits into engines of T consecutive ranks, the
first of each the host and the rest followers; T must divide the window, and with
`ranks_per_node` no engine may span two nodes. `RoleLayout.grid` places a role's grid on its
window. That the module imports neither torch nor megatron is checked in `test_layering.py`.
Nothing is faked.
"""

from __future__ import annotations

import itertools

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.distributed.layout import Parallelism, RoleGrid, RoleWindow, plan_layout
from megatron_async_rl.recipe.schema import RoleGroupSpec


def _groups(*specs):
    return [RoleGroupSpec(**spec) for spec in specs]


def test_brief_example_world_of_four():
    layout = plan_layout(
        4,
        _groups(
            {"roles": ["train"], "num_ranks": 2},
            {"roles": ["logp"], "num_ranks": 1},
            {"roles": ["ref"], "num_ranks": 1},
        ),
        {"train": Parallelism(tp=2, pp=1)},
    )
    assert layout.windows == (
        RoleWindow(("train",), 0, 2),
        RoleWindow(("logp",), 2, 1),
        RoleWindow(("ref",), 3, 1),
    )
    assert layout.window_of("train").ranks == range(0, 2)
    assert layout.parallelism["logp"] == Parallelism(1, 1)  # defaulted
    assert [layout.roles_of_rank(r) for r in range(4)] == [
        ("train",),
        ("train",),
        ("logp",),
        ("ref",),
    ]
    assert layout.rank_in_role("train", 1) == 1
    assert layout.rank_in_role("ref", 3) == 0
    assert layout.dp_of("train") == 1


def test_shared_window_and_generate():
    layout = plan_layout(
        4,
        _groups(
            {"roles": ["logp", "train"], "num_ranks": 2},
            {"roles": ["ref"], "num_ranks": 1},
            {"roles": ["generate"], "num_ranks": 1},
        ),
        {"train": Parallelism(1, 1), "logp": Parallelism(2, 1)},
    )
    assert layout.roles_of_rank(1) == ("logp", "train")
    assert layout.window_of("train") is layout.window_of("logp")
    assert (layout.dp_of("train"), layout.dp_of("logp")) == (2, 1)
    assert "generate" not in layout.parallelism
    text = layout.describe()
    assert "0-1    logp" in text and "3      generate  -" in text


def test_grid_places_a_role_on_its_window():
    groups = _groups(
        {"roles": ["logp"], "num_ranks": 2},
        {"roles": ["train"], "num_ranks": 8},
        {"roles": ["ref"], "num_ranks": 2},
    )
    par = Parallelism(tp=2, pp=2, ep=2, etp=1)
    layout = plan_layout(12, groups, {"train": par})
    grid = layout.grid("train")
    assert grid == RoleGrid(2, tp=2, pp=2, dp=2, ep=2, etp=1)
    assert grid.parallelism == par and grid.ranks == layout.window_of("train").ranks
    assert (grid.size, grid.expt_dp, layout.dp_of("train")) == (8, 2, 2)
    # tp fastest, then (cp,) dp, then pp; the expert grid etp, ep, expt_dp, pp.
    assert [grid.dense_rank(tp=t, dp=d, pp=p) for p in (0, 1) for d in (0, 1) for t in (0, 1)] == [
        *range(2, 10)
    ]
    assert grid.expert_rank(ep=1, expt_dp=1, pp=1) == 2 + 4 + 2 + 1
    assert grid.sender_ranks() == (2, 3, 6, 7)
    assert layout.grid("logp") == RoleGrid(0, tp=1, pp=1, dp=2)


def test_grid_refuses_sizes_that_do_not_make_a_grid():
    with pytest.raises(ConfigError, match=r"^config error: tp = 0: must be an integer >= 1$"):
        RoleGrid(0, tp=0, pp=1, dp=1)
    with pytest.raises(ConfigError, match=r"^config error: dp = 0: must be an integer >= 1$"):
        RoleGrid(0, tp=1, pp=1, dp=0)
    with pytest.raises(ConfigError, match=r"^config error: offset = -1: must be an integer >= 0$"):
        RoleGrid(-1, tp=1, pp=1, dp=1)
    with pytest.raises(ValueError, match="grid of 2 ranks does not split into etp=1 x ep=2 x pp=2"):
        RoleGrid(0, tp=1, pp=2, dp=1, ep=2)


def test_ratios_only():
    layout = plan_layout(
        8,
        _groups(
            {"roles": ["train", "logp"], "ratio": 0.5},
            {"roles": ["ref"], "ratio": 0.25},
            {"roles": ["generate"], "ratio": 0.25},
        ),
        {},
    )
    assert [(w.offset, w.size) for w in layout.windows] == [(0, 4), (4, 2), (6, 2)]


def test_counts_and_ratios_share_the_remainder():
    layout = plan_layout(
        8,
        _groups(
            {"roles": ["train"], "num_ranks": 4},
            {"roles": ["logp", "ref"], "ratio": 0.5},
            {"roles": ["generate"], "ratio": 0.5},
        ),
        {},
    )
    assert [(w.offset, w.size) for w in layout.windows] == [(0, 4), (4, 2), (6, 2)]


def test_counts_leave_too_few_ranks_for_ratios():
    with pytest.raises(ConfigError, match=r"rank counts leave 0 of 4 ranks for 1 ratio groups"):
        plan_layout(
            4,
            _groups(
                {"roles": ["train", "logp", "ref"], "num_ranks": 4},
                {"roles": ["generate"], "ratio": 1.0},
            ),
            {},
        )


def test_pipeline_and_context_parallel_product_must_divide():
    groups = _groups({"roles": ["train", "logp", "ref"], "num_ranks": 6})
    assert plan_layout(6, groups, {"train": Parallelism(tp=1, pp=2, cp=3)}).dp_of("train") == 1
    with pytest.raises(
        ConfigError, match=r"roles.train.megatron = 'tp=1 pp=4 cp=1': tp\*pp\*cp = 4"
    ):
        plan_layout(6, groups, {"train": Parallelism(tp=1, pp=4)})


def _expert_rule(size, tp, pp, cp, ep, etp):
    """The brief's form of Megatron's rule, written independently of layout.py."""
    if size % (tp * pp * cp):
        return False
    dp = size // (tp * pp * cp)
    return (dp * tp * cp) % (ep * etp) == 0


def test_expert_rule_matches_megatron_formula():
    groups = _groups({"roles": ["train", "logp", "ref"], "num_ranks": 8})
    for tp, pp, ep, etp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2, 4)):
        par = Parallelism(tp=tp, pp=pp, ep=ep, etp=etp)
        expected = _expert_rule(8, tp, pp, 1, ep, etp)
        try:
            plan_layout(8, groups, {"train": par})
            accepted = True
        except ConfigError:
            accepted = False
        assert accepted == expected, par


def test_expert_parallel_defaults_etp_to_tp():
    par = Parallelism.from_megatron_args(
        {
            "tensor_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": None,
        }
    )
    assert par == Parallelism(tp=2, pp=1, ep=2, cp=1, etp=2)
    assert par.dp_for(8) == 4
    with pytest.raises(ValueError, match="not a multiple"):
        par.dp_for(3)


def test_lookup_errors():
    layout = plan_layout(
        2,
        _groups({"roles": ["train", "logp"], "num_ranks": 1}, {"roles": ["ref"], "num_ranks": 1}),
        {},
    )
    with pytest.raises(ValueError, match="rank 1 is not in role 'train'"):
        layout.rank_in_role("train", 1)
    with pytest.raises(ValueError, match="role 'generate' is not placed"):
        layout.window_of("generate")
    with pytest.raises(ValueError, match="rank 2 is outside the world of 2 ranks"):
        layout.roles_of_rank(2)


def test_bad_arguments():
    groups = _groups({"roles": ["train", "logp", "ref"], "num_ranks": 1})
    with pytest.raises(ConfigError, match=r"world_size = 0: must be an integer >= 1"):
        plan_layout(0, groups, {})
    with pytest.raises(
        ConfigError, match=r"roles.generate = .*has parallel sizes but is not placed"
    ):
        plan_layout(1, groups, {"generate": Parallelism(1, 1)})
    with pytest.raises(ConfigError, match=r"tp = 0: must be an integer >= 1"):
        Parallelism(tp=0, pp=1)


def _moe_groups():
    """The 32-rank layout of yaml_configs/moe-32gpu-grpo-async.yaml."""
    return _groups(
        {"roles": ["train"], "num_ranks": 16},
        {"roles": ["logp"], "num_ranks": 4},
        {"roles": ["ref"], "num_ranks": 4},
        {"roles": ["generate"], "num_ranks": 8},
    )


def test_engine_hosts_and_followers():
    layout = plan_layout(32, _moe_groups(), {}, engine_tp_size=2, ranks_per_node=8)
    assert layout.engine_host_ranks() == (24, 26, 28, 30)
    assert [r for r in range(32) if layout.is_engine_host(r)] == [24, 26, 28, 30]
    assert [r for r in range(32) if layout.is_engine_follower(r)] == [25, 27, 29, 31]
    assert layout.engine_ranks(27) == range(26, 28) and layout.engine_ranks(30) == range(30, 32)
    with pytest.raises(ValueError, match="rank 3 is not in role 'generate'"):
        layout.engine_ranks(3)
    text = layout.describe()
    assert "engines: 4 SGLang engine(s) of engine.tp_size 2 on generate ranks 24-31" in text
    assert "  engine 3: ranks 30-31, host 30" in text
    assert text.endswith("nodes: 4 x 8 ranks (no engine spans two)")


def test_engine_tp_one_makes_every_generate_rank_a_host():
    layout = plan_layout(32, _moe_groups(), {})
    assert layout.engine_host_ranks() == tuple(range(24, 32))
    assert not any(layout.is_engine_follower(r) for r in range(32))
    assert "nodes:" not in layout.describe()
    no_generate = plan_layout(1, _groups({"roles": ["train", "logp", "ref"], "num_ranks": 1}), {})
    assert no_generate.engine_host_ranks() == () and not no_generate.is_engine_host(0)
    assert "engines:" not in no_generate.describe()


def test_generate_window_must_split_into_engines():
    with pytest.raises(
        ConfigError,
        match=r"^config error: engine.tp_size = 3: must divide the 8-rank generate window of "
        r"roles.groups\[3\] \(ranks 24-31\): each engine spans tp_size consecutive",
    ):
        plan_layout(32, _moe_groups(), {}, engine_tp_size=3)
    with pytest.raises(ConfigError, match=r"engine.tp_size = 0: must be an integer >= 1"):
        plan_layout(32, _moe_groups(), {}, engine_tp_size=0)


def test_an_engine_may_not_straddle_nodes():
    # generate on ranks 6-15 of two 8-rank nodes: TP2 engines fit, a TP5 engine 6-10 does not
    groups = _groups(
        {"roles": ["train", "logp", "ref"], "num_ranks": 6},
        {"roles": ["generate"], "num_ranks": 10},
    )
    layout = plan_layout(16, groups, {}, engine_tp_size=2, ranks_per_node=8)
    assert layout.engine_host_ranks() == (6, 8, 10, 12, 14)
    with pytest.raises(
        ConfigError,
        match=r"engine.tp_size = 5: the engine on ranks 6-10 of the 10-rank generate window .* "
        r"straddles nodes of 8 ranks",
    ):
        plan_layout(16, groups, {}, engine_tp_size=5, ranks_per_node=8)
    assert plan_layout(16, groups, {}, engine_tp_size=5).engine_host_ranks() == (6, 11)
    with pytest.raises(ConfigError, match=r"ranks_per_node = 6: must divide the world size 16"):
        plan_layout(16, groups, {}, ranks_per_node=6)
