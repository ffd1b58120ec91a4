"""The options of each Megatron role's process groups: Megatron-LM's
--nccl-communicator-config-path, --high-priority-stream-groups, --use-sharp and
--sharp-enabled-group, applied to the groups `distributed.groups` builds for the role.

Owned here: the pure plan `plan_group_options(args, backend)` (from one role's resolved Megatron
args: the NCCL options of each of its groups as plain dicts, and the group SHARP goes to),
`share_sharp` (one SHARP communicator per process), and `check_group_flags`, which
`recipe.load` runs on every role at resolution. No collectives, no NCCL: `distributed.groups`
turns a plan into `ProcessGroupNCCL.Options` with megatron-core's own
`parallel_state.get_nccl_options` and passes them to `HyperCommGrid.create_pg`, as megatron-core's
`initialize_model_parallel` does for its global groups (which this trainer never creates).

The file is Megatron-LM's YAML, a mapping of group name -> options:

    dp_cp: {max_ctas: 16, min_ctas: 8, cga_cluster_size: 2}
    tp: {net_name: IB, is_high_priority_stream: true}

Group names are megatron-core's; `GROUP_NAMES` maps each to the role group here (`ep_tp` is
`expt_tp`, `ep_dp` `expt_dp`, `tp_ep_mp` `tp_ep`, `intra_dist_opt_instance` `intra_dist_opt`);
`NOT_BUILT` are megatron-core groups that roles here do not have (their options go unused, said
once). Options are `OPTIONS`. --high-priority-stream-groups sets is_high_priority_stream on the
groups it names, over the file's, as Megatron-LM does.

SHARP (--use-sharp; --sharp-enabled-group dp, its default): megatron-core sets
NCCL_COLLNET_ENABLE=1 while it creates the data-parallel group with context parallelism (`dp_cp`,
the group DDP reduces gradients over) and initialises its communicator with a barrier, then
removes the variable. NCCL gives SHARP to one communicator per process, so where roles share a
rank window only the first of them (role order: train first) gets it. `dp_replica` names the
groups between distributed-optimizer instances, and roles here build one instance.

On gloo (a CPU world) NCCL options mean nothing: the plan is empty and says so in `notes`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from megatron_async_rl.config.errors import ConfigError, warn_once

PATH_FLAG = "--nccl-communicator-config-path"
PRIORITY_FLAG = "--high-priority-stream-groups"

GROUP_NAMES = {
    "tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": "dp_cp", "tp_cp": "tp_cp",
    "mp": "mp", "tp_dp_cp": "tp_dp_cp", "embd": "embd", "pos_embd": "pos_embd",
    "intra_dist_opt_instance": "intra_dist_opt", "ep": "ep", "ep_tp": "expt_tp",
    "ep_dp": "expt_dp", "tp_ep_mp": "tp_ep", "tp_ep_pp": "tp_ep_pp",
}  # fmt: skip
"""megatron-core's name of a group (`parallel_state.get_nccl_options`) -> the role's group."""
NOT_BUILT = ("hcp", "tp_dp", "intra_dp_cp", "intra_ep_dp", "inter_ep_dp")
"""megatron-core groups roles here do not build (hierarchical CP, tp-dp without CP, and the
groups of several distributed-optimizer instances)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


OPTIONS = {
    "is_high_priority_stream": (lambda v: isinstance(v, bool), "true or false"),
    "cga_cluster_size": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "max_ctas": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "min_ctas": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "net_name": (lambda v: isinstance(v, str) and v.lower() in ("ib", "socket"), "IB or socket"),
}
"""The fields megatron-core's `get_nccl_options` sets on `ProcessGroupNCCL.Options`."""


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    """What one role's groups are created with."""

    options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Group name here (a `ProcessGroupCollection` attribute) -> NCCL option fields."""
    sharp_group: str | None = None
    """The group created with NCCL_COLLNET_ENABLE=1 (`dp_cp`), or None."""
    notes: tuple[str, ...] = ()
    """What the flags ask that these groups cannot take (said once by the group builder)."""


def _read_file(path: str, must_exist: bool) -> dict[str, Any] | None:
    if not Path(path).is_file():
        if must_exist:
            raise ConfigError(PATH_FLAG, path, "file not found", f"relative to {Path.cwd()}")
        warn_once(f"{PATH_FLAG} = {path!r} not found on this machine: not checked (dry run)")
        return None
    try:
        tree = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        reason = " ".join(str(err).split())
        raise ConfigError(PATH_FLAG, path, f"cannot be read as YAML: {reason}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            PATH_FLAG, path, "must be a mapping of group name -> options",
            "e.g. 'dp_cp: {max_ctas: 16}' (Megatron-LM's format)",
        )  # fmt: skip
    return tree


def _check_group_name(flag: str, value: Any, name: Any) -> None:
    if name not in GROUP_NAMES and name not in NOT_BUILT:
        raise ConfigError(
            flag, value, f"names group {name!r}, which megatron-core does not have",
            f"groups: {', '.join([*GROUP_NAMES, *NOT_BUILT])}",
        )  # fmt: skip


def nccl_configs(args: dict[str, Any], must_exist: bool = True) -> dict[str, dict[str, Any]]:
    """megatron-core group name -> NCCL option fields, from the file and
    --high-priority-stream-groups, checked; {} when neither is set (or a dry run cannot see
    the file: `must_exist` False)."""
    path = args.get("nccl_communicator_config_path")
    tree = _read_file(path, must_exist) if path else {}
    configs: dict[str, dict[str, Any]] = {}
    for name, fields in (tree or {}).items():
        _check_group_name(PATH_FLAG, path, name)
        if not isinstance(fields, dict):
            raise ConfigError(PATH_FLAG, path, f"group {name}: expected a mapping of options")
        for key, value in fields.items():
            if key not in OPTIONS:
                raise ConfigError(
                    PATH_FLAG, path, f"group {name}: unknown option {key!r}",
                    f"options: {', '.join(OPTIONS)}",
                )  # fmt: skip
            valid, what = OPTIONS[key]
            if not valid(value):
                raise ConfigError(
                    PATH_FLAG, path, f"group {name}: {key} = {value!r}: must be {what}"
                )
        if fields.get("min_ctas", 1) > fields.get("max_ctas", fields.get("min_ctas", 1)):
            raise ConfigError(PATH_FLAG, path, f"group {name}: min_ctas must be <= max_ctas")
        configs[name] = dict(fields)
    priority = args.get("high_priority_stream_groups") or []
    for name in priority:
        _check_group_name(PRIORITY_FLAG, priority, name)
        configs.setdefault(name, {})["is_high_priority_stream"] = True
    return configs


def _sharp_group(args: dict[str, Any]) -> str | None:
    """The group SHARP goes to, as megatron-core's `initialize_model_parallel` decides it."""
    group = args.get("sharp_enabled_group")
    if not args.get("use_sharp"):
        if group is not None:
            raise ConfigError(
                "--sharp-enabled-group", group, "is only valid with --use-sharp (as in "
                "megatron-core)", "add --use-sharp, or drop the flag",
            )  # fmt: skip
        return None
    if group not in (None, "dp"):
        rule = (
            "enables SHARP between distributed-optimizer instances, and roles here build one"
            if group == "dp_replica"
            else "must be dp or dp_replica"
        )
        raise ConfigError("--sharp-enabled-group", group, rule, "use dp (the default)")
    return "dp_cp"


def check_group_flags(args: dict[str, Any], role: str, must_exist: bool = True) -> None:
    """ConfigError for a role's group flags that megatron-core would reject or misread."""
    try:
        nccl_configs(args, must_exist)
        _sharp_group(args)
    except ConfigError as err:
        raise ConfigError(err.key, err.value, f"{err.rule} (role {role})", err.hint) from None


def plan_group_options(args: dict[str, Any], backend: str) -> GroupOptions:
    """The options the groups of the role whose resolved Megatron args are `args` are created
    with over `backend` (see the module docstring). Pure: reads the YAML file only."""
    configs, sharp = nccl_configs(args), _sharp_group(args)
    if backend != "nccl":
        if not configs and sharp is None:
            return GroupOptions()
        flags = [PATH_FLAG] * bool(args.get("nccl_communicator_config_path"))
        flags += [PRIORITY_FLAG] * bool(args.get("high_priority_stream_groups"))
        flags += ["--use-sharp"] * (sharp is not None)
        return GroupOptions(notes=(
            f"{', '.join(flags)}: NCCL options, and the {backend} groups take none "
            "(nothing is applied on this backend)",
        ))  # fmt: skip
    unused = sorted(name for name in configs if name in NOT_BUILT)
    notes = ()
    if unused:
        notes = (f"{PATH_FLAG}: groups {', '.join(unused)} are not built here: unused",)
    options = {GROUP_NAMES[n]: fields for n, fields in configs.items() if n in GROUP_NAMES}
    return GroupOptions(options, sharp, notes)


def share_sharp(
    plans: dict[str, GroupOptions], windows: dict[str, tuple[int, ...]]
) -> dict[str, GroupOptions]:
    """`plans` with SHARP kept for the first role (in `plans`' order) of each rank window that
    asks for it: NCCL gives SHARP to one communicator per process (windows are equal or
    disjoint). A role that loses it says so in its notes."""
    taken: dict[tuple[int, ...], str] = {}
    out = {}
    for role, plan in plans.items():
        window = windows[role]
        if plan.sharp_group is not None and window in taken:
            note = (
                f"--use-sharp: role {role} shares its ranks with role {taken[window]}, whose "
                "data-parallel group holds SHARP (one per process)"
            )
            plan = dataclasses.replace(plan, sharp_group=None, notes=(*plan.notes, note))
        elif plan.sharp_group is not None:
            taken[window] = role
        out[role] = plan
    return out
