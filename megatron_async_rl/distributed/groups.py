"""Build the process groups of a carved world: one object, passed explicitly, never global.

Owned here: turning a pure `RoleLayout` into real `torch.distributed` groups. Called once by the
entry point (`train.py`) right after `init_process_group`, on every rank, in the same order:
group creation is collective over the whole world, so every rank builds every group even when it
is not a member (it then holds `None` for it).

The groups are named for what travels over them, not for a pair of roles: design.md section 2
describes "bridge groups" joining each pair of roles that exchange data, but every kind of
traffic turned out to span its own set of ranks (samples go from all generate ranks to all
Megatron ranks; weights from each sender to every receiver), so those sets are the groups. In
the order they are created:
- `control` (gloo, the world): control messages and Python objects, the final barrier;
- per Megatron role (train, logp, ref): a `ProcessGroupCollection` over its rank window, from a
  dense grid `HyperCommGrid([tp, cp, dp, pp], rank_offset=window.offset)` and an expert grid
  `HyperCommGrid([etp, ep, expt_dp, pp])` with the same window (Megatron-LM's tp-cp-dp-pp and
  tp-ep-dp-pp orders, pp outermost in both so pipeline stages agree; with the role's
  --use-tp-pp-dp-mapping, tp-cp-pp-dp and tp-ep-pp-dp: `layout.RoleGrid.dense_dims`);
  `intra_dist_opt` spans the whole role window (facts: a smaller group silently changes grad
  clipping), `inter_dist_opt` is None (one optimizer instance); each group is created with the
  NCCL options and SHARP the role's own Megatron args give it (`pg_options`; `dp_cp` first, as
  megatron-core creates it, since SHARP goes to the first communicator NCCL makes with it);
- `weight_sync` (gloo): the train ranks, engine hosts and logp ranks: each sync's outcome;
- `weight_senders` (gloo): one group per reshard sender ({sender} + receivers), and
  `weight_senders_device`, the same over the world's backend when it is not gloo (NCCL);
- `megatron` (gloo): every Megatron rank: per-step results and metrics;
- `samples` (gloo): every rank but the engine followers: samples from generate ranks.
`parallel_state.initialize_model_parallel` is never called.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_async_rl.config.errors import warn_once
from megatron_async_rl.config.roles import MEGATRON_ROLES
from megatron_async_rl.distributed import pg_options
from megatron_async_rl.distributed.layout import RoleGrid, RoleLayout

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RoleGroups:
    """The groups of one Megatron role as seen from this rank."""

    role: str
    ranks: tuple[int, ...]
    pg_collection: ProcessGroupCollection | None
    """The role's groups; None on ranks outside the role's window."""
    pp_size: int
    """Pipeline-parallel size of the role."""

    @property
    def is_member(self) -> bool:
        return self.pg_collection is not None


@dataclasses.dataclass
class WorldGroups:
    """Every group of the carved world, as seen from this rank (None where not a member)."""

    layout: RoleLayout
    rank: int
    backend: str
    control: dist.ProcessGroup
    roles: dict[str, RoleGroups]
    weight_sync: dist.ProcessGroup | None = None
    """Every rank taking part in a reshard (gloo): the train role's ranks, engine hosts and logp
    ranks. Carries the agreement on each sync's outcome (`weight_sync.broadcast`)."""
    weight_sync_ranks: tuple[int, ...] = ()
    megatron: dist.ProcessGroup | None = None
    """Every rank holding a Megatron role (gloo): their per-step results and metrics."""
    megatron_ranks: tuple[int, ...] = ()
    samples: dist.ProcessGroup | None = None
    """Every rank but the engine followers (gloo), used only for samples from generate ranks to
    the others, so that an asynchronous generate rank can feed it from its own thread. None on
    followers (generate-only ranks hosting no engine when engine.tp_size > 1)."""
    samples_ranks: tuple[int, ...] = ()
    weight_senders: dict[int, dist.ProcessGroup | None] = dataclasses.field(default_factory=dict)
    """The reshard of `weight_sync.executor`: one gloo group per sender ({sender} + receivers),
    keyed by the sender's global rank; None where this rank is not a member."""
    weight_receivers: tuple[int, ...] = ()
    """Every rank that receives weights: generate ranks hosting an engine, and logp ranks."""
    weight_senders_device: dict[int, dist.ProcessGroup | None] = dataclasses.field(
        default_factory=dict
    )
    """The same members over the world's backend when it is not gloo (NCCL: the device bridge,
    `WeightSyncConfig.bridge`); empty on CPU, where `weight_senders` serves both."""

    def weight_sender_groups(self, device: bool) -> dict[int, dist.ProcessGroup | None]:
        """The sender groups of the device bridge (`device`) or of the host one."""
        if device and self.backend != "gloo":
            return self.weight_senders_device
        return self.weight_senders

    @property
    def leader(self) -> int:
        """The rank that writes metrics, plots and traces: the first Megatron rank."""
        return self.megatron_ranks[0] if self.megatron_ranks else 0

    def local_roles(self) -> tuple[str, ...]:
        return self.layout.roles_of_rank(self.rank)


def hyper_comm_grids(grid: RoleGrid, backend: str | None = None):
    """The dense and expert `HyperCommGrid`s of a role's grid, dimensions in the grid's rank
    order (`RoleGrid.dense_dims`, `expert_dims`), so their groups hold the ranks the layout
    names. Makes no group (a `HyperCommGrid` creates one only in `create_pg`)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    return tuple(
        HyperCommGrid(
            [size for _, size in dims],
            [name for name, _ in dims],
            rank_offset=grid.offset,
            backend=backend,
        )
        for dims in (grid.dense_dims, grid.expert_dims)
    )


def _role_collection(
    grid: RoleGrid, backend: str, timeout, plan: pg_options.GroupOptions, device=None
) -> ProcessGroupCollection | None:
    """Create (collectively) the dense and expert grids of one role window, each group with
    the options `plan` gives it (megatron-core's `get_nccl_options` builds them)."""
    from megatron.core.parallel_state import get_nccl_options
    from megatron.core.process_groups_config import ProcessGroupCollection

    def kwargs(name: str) -> dict[str, Any]:
        return {"timeout": timeout, "pg_options": get_nccl_options(name, plan.options)}

    dense, expert = hyper_comm_grids(grid, backend)
    sharp = plan.sharp_group is not None and backend == "nccl"
    if sharp:
        os.environ["NCCL_COLLNET_ENABLE"] = "1"
    pgs = {"dp_cp": dense.create_pg(["cp", "dp"], **kwargs("dp_cp"))}
    if sharp:
        _initialise_with_sharp(pgs["dp_cp"], device)
    pgs.update({
        "tp": dense.create_pg("tp", **kwargs("tp")),
        "cp": dense.create_pg("cp", **kwargs("cp")),
        "dp": dense.create_pg("dp", **kwargs("dp")),
        "pp": dense.create_pg("pp", **kwargs("pp")),
        "tp_cp": dense.create_pg(["tp", "cp"], **kwargs("tp_cp")),
        "mp": dense.create_pg(["tp", "pp"], **kwargs("mp")),
        "tp_dp_cp": dense.create_pg(["tp", "cp", "dp"], **kwargs("tp_dp_cp")),
        "intra_dist_opt": dense.create_pg(["tp", "cp", "dp", "pp"], **kwargs("intra_dist_opt")),
        "expt_tp": expert.create_pg("tp", **kwargs("expt_tp")),
        "ep": expert.create_pg("ep", **kwargs("ep")),
        "expt_dp": expert.create_pg("dp", **kwargs("expt_dp")),
        "tp_ep": expert.create_pg(["tp", "ep"], **kwargs("tp_ep")),
        "tp_ep_pp": expert.create_pg(["tp", "ep", "pp"], **kwargs("tp_ep_pp")),
    })  # fmt: skip
    # Embedding group: first and last pipeline stage of every pipeline (tied-embedding grads).
    pp_enum = dense.get_rank_enum("pp")
    embd_enum = [sorted({ranks[0], ranks[-1]}) for ranks in pp_enum]
    pgs["embd"], _ = dist.new_subgroups_by_enumeration(embd_enum, backend=backend, **kwargs("embd"))
    pos_enum = [[ranks[0]] for ranks in pp_enum]
    pgs["pos_embd"], _ = dist.new_subgroups_by_enumeration(
        pos_enum, backend=backend, **kwargs("pos_embd")
    )

    if dist.get_rank() not in grid.ranks:
        return None
    collection = ProcessGroupCollection()
    for name, group in pgs.items():
        setattr(collection, name, group)
    collection.intra_dp_cp = collection.dp_cp
    collection.intra_expt_dp = collection.expt_dp
    collection.inter_dist_opt = None
    collection.hcp = None
    return collection


def _initialise_with_sharp(group: dist.ProcessGroup | None, device) -> None:
    """megatron-core's SHARP: the group's NCCL communicator is made now on this rank's `device`
    (PyTorch makes them lazily), while NCCL_COLLNET_ENABLE=1, and the variable is then removed
    so that no later communicator asks for SHARP too."""
    import torch

    try:
        if group is not None:
            if device is None:
                raise RuntimeError("SHARP (--use-sharp) needs the rank's CUDA device to "
                                   "initialise the data-parallel group's communicator")  # fmt: skip
            dist.barrier(group=group, device_ids=[device.index])
            torch.cuda.synchronize(device)
    finally:
        os.environ.pop("NCCL_COLLNET_ENABLE", None)


def _group_plans(
    layout: RoleLayout, backend: str, role_args: dict[str, dict] | None
) -> dict[str, pg_options.GroupOptions]:
    """Each placed Megatron role's `pg_options` plan, from its own Megatron args; every rank
    plans alike (the args and the layout are the same everywhere)."""
    roles = [role for role in MEGATRON_ROLES if role in layout.parallelism]
    plans = {
        role: pg_options.plan_group_options((role_args or {}).get(role, {}), backend)
        for role in roles
    }
    windows = {role: tuple(layout.grid(role).ranks) for role in roles}
    plans = pg_options.share_sharp(plans, windows)
    if dist.get_rank() == 0:
        for plan in plans.values():
            for note in plan.notes:
                warn_once(note)
    return plans


def _weight_sender_groups(layout: RoleLayout, followers: set[int], timeout, backend="gloo"):
    """One group per reshard sender (collective, sender order); and the receiver ranks."""
    placed = {role for window in layout.windows for role in window.roles}
    if "train" not in placed or "train" not in layout.parallelism:
        return {}, ()
    receivers = set()
    for role in ("generate", "logp"):
        if role in placed:
            receivers |= set(layout.window_of(role).ranks) - followers
    if not receivers:
        return {}, ()
    senders = layout.grid("train").sender_ranks()
    groups = {}
    for sender in senders:
        members = sorted(receivers | {sender})
        group = dist.new_group(members, backend=backend, timeout=timeout)
        groups[sender] = group if dist.get_rank() in members else None
    return groups, tuple(sorted(receivers))


def build_world_groups(
    layout: RoleLayout,
    backend: str,
    timeout: datetime.timedelta | None = None,
    control_timeout: datetime.timedelta | None = None,
    role_args: dict[str, dict] | None = None,
    device=None,
) -> WorldGroups:
    """Build every group of `layout` (collective: call on every rank, same arguments).

    `timeout`: how long any collective on these groups may wait before torch.distributed fails
    it (`ResolvedConfig.collective_timeout_s`); None: torch's default (10 min for NCCL, 30 min
    for gloo). `control_timeout`: the same for `control`, whose barriers also wait for engines
    to start; None: `timeout`. `role_args`: each Megatron role's resolved args
    (`ResolvedConfig.role_megatron_args`), whose group flags set its groups' options (`pg_options`);
    None: none."""
    if not dist.is_initialized():
        raise RuntimeError("build_world_groups needs torch.distributed to be initialised first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != layout.world_size:
        raise RuntimeError(
            f"layout was planned for world size {layout.world_size} but torch.distributed has "
            f"{world_size} ranks (global rank {rank})"
        )
    control = dist.new_group(
        list(range(world_size)), backend="gloo", timeout=control_timeout or timeout
    )
    roles: dict[str, RoleGroups] = {}
    for role, plan in _group_plans(layout, backend, role_args).items():
        grid = layout.grid(role)
        roles[role] = RoleGroups(
            role=role,
            ranks=tuple(grid.ranks),
            pg_collection=_role_collection(grid, backend, timeout, plan, device),
            pp_size=grid.pp,
        )
    placed = {role for window in layout.windows for role in window.roles}
    # Engine followers (generate-only ranks that host no engine) take no part in weight or
    # sample traffic: SGLang's own TP workers on the host carry their share.
    followers = {
        r
        for r in range(world_size)
        if layout.roles_of_rank(r) == ("generate",) and layout.is_engine_follower(r)
    }
    sync_ranks: tuple[int, ...] = ()
    weight_sync = None
    if "train" in placed and ({"generate", "logp"} & placed):
        members = set(layout.window_of("train").ranks)
        for role in ("generate", "logp"):
            if role in placed:
                members |= set(layout.window_of(role).ranks) - followers
        sync_ranks = tuple(sorted(members))
        group = dist.new_group(list(sync_ranks), backend="gloo", timeout=timeout)
        weight_sync = group if rank in sync_ranks else None
    weight_senders, receivers = _weight_sender_groups(layout, followers, timeout)
    weight_senders_device = {}
    if backend != "gloo":
        weight_senders_device, _ = _weight_sender_groups(layout, followers, timeout, backend)
    megatron_ranks = tuple(sorted({r for name in roles for r in roles[name].ranks}))
    megatron = None
    if megatron_ranks:
        megatron = dist.new_group(list(megatron_ranks), backend="gloo", timeout=timeout)
    samples_ranks = tuple(r for r in range(world_size) if r not in followers)
    samples = dist.new_group(list(samples_ranks), backend="gloo", timeout=timeout)
    logger.info("rank %d: built groups for roles %s", rank, layout.roles_of_rank(rank))
    return WorldGroups(
        layout=layout,
        rank=rank,
        backend=backend,
        control=control,
        roles=roles,
        weight_sync=weight_sync,
        weight_sync_ranks=sync_ranks,
        megatron=megatron if rank in megatron_ranks else None,
        megatron_ranks=megatron_ranks,
        samples=samples if rank in samples_ranks else None,
        samples_ranks=samples_ranks,
        weight_senders=weight_senders,
        weight_receivers=receivers,
        weight_senders_device=weight_senders_device,
    )
