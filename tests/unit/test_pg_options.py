"""The options of the role groups: --nccl-communicator-config-path, --high-priority-stream-groups,
--use-sharp and --sharp-enabled-group (`distributed.pg_options`, applied by `distributed.groups`).

Contract: `plan_group_options` maps a role's args and the backend to each group's NCCL option
fields, with megatron-core's group names translated to the role's (`ep_tp` -> `expt_tp`, ...)
and --high-priority-stream-groups setting is_high_priority_stream over the file's; SHARP goes to
`dp_cp`, once per rank window (`share_sharp`); on gloo the plan is empty and its note says so.
Every bad setting (missing, unreadable or malformed file, unknown group, unknown option, bad
option value, --sharp-enabled-group without --use-sharp or naming dp_replica) is a ConfigError
naming the flag, the value and the rule, at config resolution too. `groups._role_collection`
passes each group the options megatron-core's `get_nccl_options` builds from the plan, creates
`dp_cp` first, and with SHARP holds NCCL_COLLNET_ENABLE=1 exactly while it creates `dp_cp` and
initialises it with a barrier. Faked, in the last two tests only: HyperCommGrid, the group and
barrier calls (recording fakes; the real ones run in every distributed test) and
`ProcessGroupNCCL` (this CPU build of torch has none; `tests/gpu/test_pg_options_cuda.py` uses
the real one).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.distributed import pg_options

CONFIG = """\
dp_cp: {max_ctas: 16, min_ctas: 8, cga_cluster_size: 2}
tp: {net_name: IB}
ep_tp: {max_ctas: 4}
hcp: {max_ctas: 2}
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text(CONFIG)
    return str(path)


def test_the_plan_maps_megatron_groups_to_the_roles(config_file):
    args = {"nccl_communicator_config_path": config_file,
            "high_priority_stream_groups": ["tp", "ep_dp"]}  # fmt: skip
    plan = pg_options.plan_group_options(args, "nccl")
    assert plan.options == {
        "dp_cp": {"max_ctas": 16, "min_ctas": 8, "cga_cluster_size": 2},
        "tp": {"net_name": "IB", "is_high_priority_stream": True},
        "expt_tp": {"max_ctas": 4},
        "expt_dp": {"is_high_priority_stream": True},
    }
    assert plan.sharp_group is None
    assert plan.notes == (f"{pg_options.PATH_FLAG}: groups hcp are not built here: unused",)
    assert pg_options.plan_group_options({}, "nccl") == pg_options.GroupOptions()


def test_sharp_goes_to_dp_cp_once_per_rank_window():
    sharp = pg_options.plan_group_options({"use_sharp": True}, "nccl")
    assert sharp.sharp_group == "dp_cp"
    assert (
        pg_options.plan_group_options({"use_sharp": True, "sharp_enabled_group": "dp"}, "nccl")
        == sharp
    )
    plans = {"train": sharp, "logp": sharp, "ref": sharp}
    shared = pg_options.share_sharp(plans, {"train": (0, 1), "logp": (0, 1), "ref": (2,)})
    assert [shared[r].sharp_group for r in plans] == ["dp_cp", None, "dp_cp"]
    assert "role logp shares its ranks with role train" in shared["logp"].notes[0]


def test_gloo_takes_no_options_and_says_so(config_file):
    args = {"nccl_communicator_config_path": config_file, "use_sharp": True}
    plan = pg_options.plan_group_options(args, "gloo")
    assert plan.options == {} and plan.sharp_group is None
    assert plan.notes == (
        f"{pg_options.PATH_FLAG}, --use-sharp: NCCL options, and the gloo groups take none "
        "(nothing is applied on this backend)",
    )
    assert pg_options.plan_group_options({}, "gloo").notes == ()


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("[1, 2]", r"must be a mapping of group name -> options"),
        ("dp: {max_ctas: [", r"cannot be read as YAML"),
        ("dpp: {max_ctas: 8}", r"names group 'dpp', which megatron-core does not have"),
        ("dp: 8", r"group dp: expected a mapping of options"),
        ("dp: {max_cta: 8}", r"group dp: unknown option 'max_cta'; hint: options: "),
        ("dp: {max_ctas: 0}", r"group dp: max_ctas = 0: must be an integer >= 1"),
        ("dp: {net_name: ethernet}", r"group dp: net_name = 'ethernet': must be IB or socket"),
        (
            "dp: {is_high_priority_stream: 1}",
            r"group dp: is_high_priority_stream = 1: must be true",
        ),
        ("dp: {min_ctas: 8, max_ctas: 4}", r"group dp: min_ctas must be <= max_ctas"),
    ],
)
def test_bad_files_are_refused(tmp_path, text, pattern):
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^config error: --nccl-communicator-config-path = "
                       rf"'{path}': {pattern}"):  # fmt: skip
        pg_options.plan_group_options({"nccl_communicator_config_path": str(path)}, "nccl")


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ({"nccl_communicator_config_path": "/no/such.yaml"},
         r"--nccl-communicator-config-path = '/no/such.yaml': file not found"),
        ({"high_priority_stream_groups": ["dp", "dpp"]},
         r"--high-priority-stream-groups = \['dp', 'dpp'\]: names group 'dpp', which"),
        ({"sharp_enabled_group": "dp"},
         r"--sharp-enabled-group = 'dp': is only valid with --use-sharp"),
        ({"use_sharp": True, "sharp_enabled_group": "dp_replica"},
         r"--sharp-enabled-group = 'dp_replica': enables SHARP between distributed-optimizer "
         r"instances, and roles here build one; hint: use dp"),
        ({"use_sharp": True, "sharp_enabled_group": "tp"},
         r"--sharp-enabled-group = 'tp': must be dp or dp_replica"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        pg_options.plan_group_options(args, "nccl")
    with pytest.raises(ConfigError, match=pattern.split("; hint")[0] + r".* \(role train\)"):
        pg_options.check_group_flags(args, "train")


def test_the_recipe_checks_the_flags(tmp_path, config_file, caplog):
    from megatron_async_rl.config.errors import warn_once
    from megatron_async_rl.recipe.load import build_config

    tree = {
        "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
        "megatron": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                     "vocab_size": 128, "lr": 1e-5},
    }  # fmt: skip
    flags = ["--nccl-communicator-config-path", config_file, "--use-sharp",
             "--high-priority-stream-groups", "dp_cp"]  # fmt: skip
    cfg = build_config(tree, flags)
    assert cfg.role_megatron_args["logp"]["use_sharp"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text("dp: {max_cta: 8}")
    with pytest.raises(ConfigError, match=r"unknown option 'max_cta' \(role train\)"):
        build_config(tree, ["--nccl-communicator-config-path", str(bad)])
    with pytest.raises(ConfigError, match=r"--sharp-enabled-group = 'tp': must be one of dp"):
        build_config(tree, ["--use-sharp", "--sharp-enabled-group", "tp"])
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING):  # a dry run on a machine without the cluster's file
        build_config(tree, ["--nccl-communicator-config-path", "/cluster/nccl.yaml"], False)
    assert "'/cluster/nccl.yaml' not found on this machine: not checked (dry run)" in caplog.text


class _Options:
    """A stand-in for `ProcessGroupNCCL.Options` (absent from this CPU build of torch), with
    the fields megatron-core's `get_nccl_options` sets."""

    def __init__(self, is_high_priority_stream=False):
        self.is_high_priority_stream = is_high_priority_stream
        self.config = SimpleNamespace()


def _record_groups(monkeypatch, backend_calls):
    """Fakes of what `_role_collection` calls to make groups: each call is recorded with its
    options and NCCL_COLLNET_ENABLE at that moment."""
    import torch
    import torch.distributed as dist
    from megatron.core import hyper_comm_grid

    from megatron_async_rl.distributed import groups

    class Grid:
        def __init__(self, shape, dim_names, rank_offset=0, backend=None):
            self.dim_names = dim_names

        def create_pg(self, dims, **kwargs):
            name = "-".join(dims) if isinstance(dims, list) else dims
            backend_calls.append(
                (name, kwargs["pg_options"], os.environ.get("NCCL_COLLNET_ENABLE"))
            )
            return f"group {name}"

        def get_rank_enum(self, dims):
            return [[0]]

    def subgroups(enum, backend=None, **kwargs):
        backend_calls.append(("enum", kwargs["pg_options"], os.environ.get("NCCL_COLLNET_ENABLE")))
        return None, []

    monkeypatch.setattr(hyper_comm_grid, "HyperCommGrid", Grid)
    monkeypatch.setattr(groups.dist, "new_subgroups_by_enumeration", subgroups)
    monkeypatch.setattr(groups.dist, "get_rank", lambda: 5)  # not a member: no collection
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=_Options), raising=False)
    monkeypatch.setattr(
        groups.dist, "barrier",
        lambda group, device_ids: backend_calls.append(
            ("barrier", group, os.environ.get("NCCL_COLLNET_ENABLE"))
        ),
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return groups


def _grid():
    from megatron_async_rl.distributed.layout import RoleGrid

    return RoleGrid(offset=0, tp=1, cp=1, dp=1, pp=1, ep=1, etp=1)


def test_the_groups_are_created_with_the_planned_options(monkeypatch, config_file):
    calls = []
    groups = _record_groups(monkeypatch, calls)
    args = {"nccl_communicator_config_path": config_file, "high_priority_stream_groups": ["pp"]}
    plan = pg_options.plan_group_options(args, "nccl")
    assert groups._role_collection(_grid(), "nccl", None, plan) is None
    options = {}
    for name, opts, _ in calls:
        options.setdefault(name, opts)  # the dense grid's first (the expert grid's tp follows)
    assert calls[0][0] == "cp-dp"  # dp_cp first, as megatron-core creates it
    assert vars(options["cp-dp"].config) == {"cga_cluster_size": 2, "max_ctas": 16, "min_ctas": 8}
    assert options["cp-dp"].is_high_priority_stream is False
    assert vars(options["tp"].config) == {"net_name": "IB"}
    assert options["pp"].is_high_priority_stream is True
    expert_tp = [opts for name, opts, _ in calls if name == "tp"][1]  # the expert grid's tp
    assert vars(expert_tp.config) == {"max_ctas": 4}
    assert options["dp"] is None and options["enum"] is None
    assert all(env is None for _, _, env in calls)  # no SHARP asked

    calls.clear()  # the same plan on gloo passes nothing
    gloo = pg_options.plan_group_options(args, "gloo")
    groups._role_collection(_grid(), "gloo", None, gloo)
    assert all(opts is None for _, opts, _ in calls)


def test_sharp_holds_collnet_while_dp_cp_is_made(monkeypatch):
    calls = []
    groups = _record_groups(monkeypatch, calls)
    monkeypatch.setenv("NCCL_COLLNET_ENABLE", "0")
    plan = pg_options.plan_group_options({"use_sharp": True}, "nccl")
    groups._role_collection(_grid(), "nccl", None, plan, torch.device("cuda", 0))
    assert calls[:2] == [("cp-dp", None, "1"), ("barrier", "group cp-dp", "1")]
    assert all(env is None for _, _, env in calls[2:])
    assert "NCCL_COLLNET_ENABLE" not in os.environ


def test_the_builder_says_once_what_gloo_ignores(monkeypatch, config_file, caplog):
    from megatron_async_rl.config.errors import warn_once
    from megatron_async_rl.config.roles import RoleGroupSpec
    from megatron_async_rl.distributed import groups
    from megatron_async_rl.distributed.layout import plan_layout

    layout = plan_layout(2, [RoleGroupSpec(["train"], num_ranks=1),
                             RoleGroupSpec(["logp", "ref"], num_ranks=1)], {})  # fmt: skip
    args = {"nccl_communicator_config_path": config_file}
    monkeypatch.setattr(groups.dist, "get_rank", lambda: 0)
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        plans = groups._group_plans(layout, "gloo", dict.fromkeys(("train", "logp", "ref"), args))
    assert all(plan.options == {} for plan in plans.values())
    assert caplog.text.count("the gloo groups take none") == 1
