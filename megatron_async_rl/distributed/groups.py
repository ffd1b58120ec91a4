"""Build the process groups of a carved world: one object, passed explicitly, never global.

Owned here: turning a pure `RoleLayout` into real `torch.distributed` groups. Called once by the
entry point (`train.py`) right after `init_process_group`, on every rank, in the same order:
group creation is collective over the whole world, so every rank builds every role's groups
even when it is not a member (it then holds `None` for them).

What is built (design.md section 2):
- per Megatron role (train, logp, ref): a `ProcessGroupCollection` over its rank window, from a
  dense grid `HyperCommGrid([tp, cp, dp, pp], rank_offset=window.offset)` and an expert grid
  `HyperCommGrid([etp, ep, expt_dp, pp])` with the same window (Megatron's tp-cp-dp-pp and
  tp-ep-dp-pp orders, pp outermost in both so pipeline stages agree);
- `intra_dist_opt` spans the whole role window (facts: a smaller group silently changes grad
  clipping), `inter_dist_opt` is None (one optimizer instance);
- bridge groups: the union of the two windows of every pair of roles that exchange data;
- `control`: a gloo group over the world for control messages and Python objects.
`parallel_state.initialize_model_parallel` is never called.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch.distributed as dist

from megatron_async_rl.distributed.layout import RoleGrid, RoleLayout

logger = logging.getLogger(__name__)

MEGATRON_ROLES = ("train", "logp", "ref")
# Pairs of roles that exchange data (weights train->generate; samples between the others).
BRIDGE_PAIRS = (
    ("train", "generate"),
    ("generate", "logp"),
    ("generate", "ref"),
    ("logp", "train"),
    ("ref", "train"),
)


@dataclasses.dataclass
class RoleGroups:
    """The groups of one Megatron role as seen from this rank."""

    role: str
    ranks: tuple[int, ...]
    #: None on ranks outside the role's window.
    pg_collection: Optional[object]
    #: Pipeline-parallel size of the role.
    pp_size: int

    @property
    def is_member(self) -> bool:
        return self.pg_collection is not None


@dataclasses.dataclass
class WorldGroups:
    """Every group of the carved world, as seen from this rank."""

    layout: RoleLayout
    rank: int
    backend: str
    control: dist.ProcessGroup
    roles: dict[str, RoleGroups]
    bridges: dict[tuple[str, str], Optional[dist.ProcessGroup]]
    #: every rank taking part in a reshard (gloo): the train role's ranks, engine hosts and
    #: logp ranks. Carries the agreement on each sync's outcome (`weight_sync.broadcast`).
    weight_sync: Optional[dist.ProcessGroup] = None
    weight_sync_ranks: tuple[int, ...] = ()
    #: every rank holding a Megatron role (gloo): their per-step results and metrics.
    megatron: Optional[dist.ProcessGroup] = None
    megatron_ranks: tuple[int, ...] = ()
    #: every rank but the engine followers (gloo), used only for samples from generate ranks
    #: to the others, so that an asynchronous generate rank can feed it from its own thread.
    #: None on followers (generate-only ranks hosting no engine when engine.tp_size > 1).
    samples: Optional[dist.ProcessGroup] = None
    samples_ranks: tuple[int, ...] = ()
    #: the reshard of `weight_sync.executor`: one gloo group per sender ({sender} + receivers),
    #: keyed by the sender's global rank; None where this rank is not a member.
    weight_senders: dict[int, Optional[dist.ProcessGroup]] = dataclasses.field(default_factory=dict)
    #: every rank that receives weights: generate ranks hosting an engine, and logp ranks.
    weight_receivers: tuple[int, ...] = ()
    #: the same members over the world's backend when it is not gloo (NCCL: the device
    #: bridge, `WeightSyncConfig.bridge`); empty on CPU, where `weight_senders` serves both.
    weight_senders_device: dict[int, Optional[dist.ProcessGroup]] = dataclasses.field(
        default_factory=dict
    )

    def weight_sender_groups(self, device: bool) -> dict[int, Optional[dist.ProcessGroup]]:
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

    def bridge(self, src: str, dst: str) -> Optional[dist.ProcessGroup]:
        key = (src, dst) if (src, dst) in self.bridges else (dst, src)
        if key not in self.bridges:
            raise KeyError(f"no bridge group between roles {src!r} and {dst!r}")
        return self.bridges[key]


def _role_collection(grid: RoleGrid, backend: str):
    """Create (collectively) the dense and expert grids of one role window."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    dense = HyperCommGrid(
        [grid.tp, grid.cp, grid.dp, grid.pp],
        ["tp", "cp", "dp", "pp"],
        rank_offset=grid.offset,
        backend=backend,
    )
    expert = HyperCommGrid(
        [grid.etp, grid.ep, grid.expt_dp, grid.pp],
        ["tp", "ep", "dp", "pp"],
        rank_offset=grid.offset,
        backend=backend,
    )
    pgs = {
        "tp": dense.create_pg("tp"),
        "cp": dense.create_pg("cp"),
        "dp": dense.create_pg("dp"),
        "pp": dense.create_pg("pp"),
        "dp_cp": dense.create_pg(["cp", "dp"]),
        "tp_cp": dense.create_pg(["tp", "cp"]),
        "mp": dense.create_pg(["tp", "pp"]),
        "tp_dp_cp": dense.create_pg(["tp", "cp", "dp"]),
        "intra_dist_opt": dense.create_pg(["tp", "cp", "dp", "pp"]),
        "expt_tp": expert.create_pg("tp"),
        "ep": expert.create_pg("ep"),
        "expt_dp": expert.create_pg("dp"),
        "tp_ep": expert.create_pg(["tp", "ep"]),
        "tp_ep_pp": expert.create_pg(["tp", "ep", "pp"]),
    }
    # Embedding group: first and last pipeline stage of every pipeline (tied-embedding grads).
    pp_enum = dense.get_rank_enum("pp")
    embd_enum = [sorted({ranks[0], ranks[-1]}) for ranks in pp_enum]
    pgs["embd"], _ = dist.new_subgroups_by_enumeration(embd_enum, backend=backend)
    pos_enum = [[ranks[0]] for ranks in pp_enum]
    pgs["pos_embd"], _ = dist.new_subgroups_by_enumeration(pos_enum, backend=backend)

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


def _weight_sender_groups(layout: RoleLayout, followers: set[int], backend: str = "gloo"):
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
        group = dist.new_group(members, backend=backend)
        groups[sender] = group if dist.get_rank() in members else None
    return groups, tuple(sorted(receivers))


def build_world_groups(layout: RoleLayout, backend: str) -> WorldGroups:
    """Build every group of `layout` (collective: call on every rank, same arguments)."""
    if not dist.is_initialized():
        raise RuntimeError("build_world_groups needs torch.distributed to be initialised first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != layout.world_size:
        raise RuntimeError(
            f"layout was planned for world size {layout.world_size} but torch.distributed has "
            f"{world_size} ranks (global rank {rank})"
        )
    control = dist.new_group(list(range(world_size)), backend="gloo")
    roles: dict[str, RoleGroups] = {}
    for role in MEGATRON_ROLES:
        if role not in layout.parallelism:
            continue
        grid = layout.grid(role)
        roles[role] = RoleGroups(
            role=role,
            ranks=tuple(grid.ranks),
            pg_collection=_role_collection(grid, backend),
            pp_size=grid.pp,
        )
    bridges: dict[tuple[str, str], Optional[dist.ProcessGroup]] = {}
    placed = {role for window in layout.windows for role in window.roles}
    for src, dst in BRIDGE_PAIRS:
        if src not in placed or dst not in placed:
            continue
        ranks = sorted(set(layout.window_of(src).ranks) | set(layout.window_of(dst).ranks))
        group = dist.new_group(ranks, backend=backend)
        bridges[(src, dst)] = group if rank in ranks else None
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
        group = dist.new_group(list(sync_ranks), backend="gloo")
        weight_sync = group if rank in sync_ranks else None
    weight_senders, receivers = _weight_sender_groups(layout, followers)
    weight_senders_device = {}
    if backend != "gloo":
        weight_senders_device, _ = _weight_sender_groups(layout, followers, backend)
    megatron_ranks = tuple(sorted({r for name in roles for r in roles[name].ranks}))
    megatron = dist.new_group(list(megatron_ranks), backend="gloo") if megatron_ranks else None
    samples_ranks = tuple(r for r in range(world_size) if r not in followers)
    samples = dist.new_group(list(samples_ranks), backend="gloo")
    logger.info("rank %d: built groups for roles %s", rank, layout.roles_of_rank(rank))
    return WorldGroups(
        layout,
        rank,
        backend,
        control,
        roles,
        bridges,
        weight_sync,
        sync_ranks,
        megatron if rank in megatron_ranks else None,
        megatron_ranks,
        samples if rank in samples_ranks else None,
        samples_ranks=samples_ranks,
        weight_senders=weight_senders,
        weight_receivers=receivers,
        weight_senders_device=weight_senders_device,
    )
