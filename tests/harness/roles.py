"""Megatron roles for rank workers: their Megatron arguments from a HF checkpoint, and roles built
over one window of ranks.

Called inside spawned ranks (`tests/harness/ranks.py`) by the tests in tests/distributed and
tests/gpu; `role_args` also in the test process (a layout's parallel sizes).
"""

from __future__ import annotations


def role_args(path: str, **parallel) -> dict:
    """Megatron arguments for the HF checkpoint at `path`: the package's defaults, the model's
    sizes, then `parallel` and lr 1e-5; an MoE model's router has no load-balancing loss."""
    from megatron_async_rl.config.megatron import table
    from megatron_async_rl.models import hf_checkpoint, hf_config

    args = table.defaults()
    args.update(hf_config.megatron_args_from_hf(hf_checkpoint.read_hf_config(path)))
    args.update(parallel, lr=1e-5)
    if args.get("num_experts"):
        args["moe_router_load_balancing_type"] = "none"
    return args


def one_window_roles(name, world_size, path, parallel, *, windows=None, extra=None, seed=5):
    """A `MegatronRole` named `name` (with `parallel`) over a fresh layout of `windows` (role
    -> its parallel sizes; default one window with `name` only), built with `seed`; every role
    loaded from `path`. Returns ({role: MegatronRole}, the world's groups)."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    windows = windows or {name: parallel}
    args = {role: {**role_args(path, **par), **(extra or {})} for role, par in windows.items()}
    pars = {role: Parallelism.from_megatron_args(a) for role, a in args.items()}
    spec = [RoleGroupSpec(roles=list(windows), num_ranks=world_size)]
    layout = plan_layout(world_size, spec, pars)
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    roles = {
        role: MegatronRole(role, args[role], pars[role], groups.roles[role], platform, seed=seed)
        for role in windows
    }
    for role in roles.values():
        role.load_hf_checkpoint(path)
    return roles, groups
