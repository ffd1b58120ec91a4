"""The pure rank layout: (world size, role groups, per-role parallelism) -> rank windows.

Each `roles.groups` entry becomes a `RoleWindow`, a contiguous range of global ranks laid out in
recipe order from rank 0. Roles listed together share the window's ranks. Each Megatron role's
process groups are later built over its window (`HyperCommGrid(..., rank_offset=window.offset)`)
by the group builder; `RoleLayout.grid(role)` is that role's `RoleGrid`, the global rank of each
grid coordinate, which the group builder and the reshard planner both read. This module only
decides and checks the numbers, so it imports neither `torch.distributed` nor megatron and is
unit-tested alone.

    world 4, groups [train x2, logp x1, ref x1], train TP=2:

    rank:    0      1      2      3
    window:  [train     ]  [logp] [ref]
             TP=2 DP=1     DP=1   DP=1

Inside a Megatron role's window, ranks follow Megatron-LM's order: tp fastest, then cp, ep, dp
and pp slowest ("tp-cp-ep-dp-pp"); with the role's --use-tp-pp-dp-mapping, pp comes before dp
("tp-cp-ep-pp-dp"): a replica's pipeline stages sit next to each other.

    train window of 4 ranks, pp=2 dp=2:  rank  0     1     2     3
        tp-cp-ep-dp-pp (default)         pp,dp 0,0   0,1   1,0   1,1
        tp-cp-ep-pp-dp (the flag)        pp,dp 0,0   1,0   0,1   1,1

Engines: with `engine.tp_size = T` each SGLang engine spans T consecutive ranks of the generate
window. The first rank of each group of T is the engine *host* (it starts `sglang.Engine`, whose
TP workers use that rank's local GPU and the next T-1); the other T-1 ranks are *followers*: they
hold no model and take no part in sample or weight traffic. When the ranks per node are known,
an engine may not straddle two nodes (its TP workers are local processes of the host).

    generate window of 8 ranks (24-31), engine.tp_size = 2:

    rank:    24 25   26 27   28 29   30 31
    engine:  [0   ]  [1   ]  [2   ]  [3   ]      hosts 24, 26, 28, 30; followers 25, 27, 29, 31
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import require_int
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.roles import MEGATRON_ROLES, RoleGroupSpec

_TOLERANCE = 1e-6

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron-LM's rank order (`initialize_model_parallel(order=...)`), fastest first."""
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
"""The order --use-tp-pp-dp-mapping asks for (Megatron-LM's `initialize.py`)."""
ORDERS = (DEFAULT_ORDER, TP_PP_DP_ORDER)


@dataclass(frozen=True)
class Parallelism:
    """One Megatron role's model-parallel sizes; data parallelism fills the rest of its window."""

    tp: int
    pp: int
    ep: int = 1
    cp: int = 1
    etp: int = 1
    """Expert tensor parallel size. Megatron defaults it to tp (see `from_megatron_args`)."""
    order: str = DEFAULT_ORDER
    """Rank order inside the window, one of `ORDERS` (TP_PP_DP_ORDER: --use-tp-pp-dp-mapping)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "etp"):
            require_int(name, getattr(self, name), 1)
        if self.order not in ORDERS:
            raise ValueError(f"rank order {self.order!r} is not one of {ORDERS}")

    @property
    def pp_groups_agree(self) -> bool:
        """Whether the dense and expert grids put the same ranks in each pipeline group, as
        megatron-core requires: always with pp slowest; with pp before dp, when pp = 1 or the
        expert grid's etp*ep equals the dense grid's tp*cp (its data-parallel sizes then agree)."""
        if self.order == DEFAULT_ORDER or self.pp == 1:
            return True
        return self.etp * self.ep == self.tp * self.cp

    @classmethod
    def from_megatron_args(cls, args: dict) -> Parallelism:
        """From resolved Megatron args (dest names), as megatron-core reads them."""
        tp = args.get("tensor_model_parallel_size", 1)
        return cls(
            tp=tp,
            pp=args.get("pipeline_model_parallel_size", 1),
            ep=args.get("expert_model_parallel_size", 1),
            cp=args.get("context_parallel_size", 1),
            etp=args.get("expert_tensor_parallel_size") or tp,
            order=TP_PP_DP_ORDER if args.get("use_tp_pp_dp_mapping") else DEFAULT_ORDER,
        )

    @property
    def model_size(self) -> int:
        """Ranks holding one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def dp_for(self, size: int) -> int:
        """Data-parallel size on a window of `size` ranks."""
        if size % self.model_size:
            raise ValueError(f"window size {size} is not a multiple of tp*pp*cp={self.model_size}")
        return size // self.model_size


@dataclass(frozen=True)
class RoleGrid:
    """A Megatron role's grid placed on its window: the global rank of every grid coordinate.

    Dense grid (tp, cp, dp, pp) and expert grid (etp, ep, expt_dp, pp), in `order` (tp fastest;
    the dense grid skips ep, the expert grid cp): the orders of the `HyperCommGrid`s that
    `distributed.groups` builds over the window (`dense_dims`, `expert_dims`), so `dense_rank`
    and `expert_rank` name the ranks of those groups (tested against megatron-core's own
    enumerations). Made by `RoleLayout.grid(role)`; the reshard planner (`weight_sync.plan`)
    takes the train role's grid.
    """

    offset: int
    """Global rank of coordinate (0, 0, 0, 0): the window's first rank."""
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = DEFAULT_ORDER
    """Rank order, one of `ORDERS` (`Parallelism.order`)."""

    def __post_init__(self) -> None:
        require_int("offset", self.offset, 0)
        require_int("dp", self.dp, 1)
        par = self.parallelism  # raises on a bad size or order
        if self.size % (self.etp * self.ep * self.pp):
            raise ValueError(
                f"grid of {self.size} ranks does not split into etp={self.etp} x ep={self.ep} x "
                f"pp={self.pp}"
            )
        if not par.pp_groups_agree:
            raise ValueError(
                f"rank order {self.order} with pp={self.pp}: etp*ep={self.etp * self.ep} must "
                f"equal tp*cp={self.tp * self.cp} (the pipeline groups of both grids must agree)"
            )

    @property
    def parallelism(self) -> Parallelism:
        """The model-parallel sizes of this grid."""
        return Parallelism(self.tp, self.pp, self.ep, self.cp, self.etp, self.order)

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def ranks(self) -> range:
        """The global ranks of the grid (its window)."""
        return range(self.offset, self.offset + self.size)

    @property
    def expt_dp(self) -> int:
        """Expert data-parallel size: what the expert grid etp*ep*pp leaves of the window."""
        return self.size // (self.etp * self.ep * self.pp)

    @property
    def dense_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the dense grid's dimensions, fastest first."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        return tuple((name, sizes[name]) for name in self.order.split("-") if name in sizes)

    @property
    def expert_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the expert grid's dimensions, fastest first (tp: etp, dp: expt_dp)."""
        sizes = {"tp": self.etp, "ep": self.ep, "dp": self.expt_dp, "pp": self.pp}
        return tuple((name, sizes[name]) for name in self.order.split("-") if name in sizes)

    def _rank(self, dims: tuple[tuple[str, int], ...], coords: dict[str, int]) -> int:
        index, stride = 0, 1
        for name, size in dims:
            index += coords[name] * stride
            stride *= size
        return self.offset + index

    def dense_rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return self._rank(self.dense_dims, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})

    def expert_rank(self, etp: int = 0, ep: int = 0, expt_dp: int = 0, pp: int = 0) -> int:
        return self._rank(self.expert_dims, {"tp": etp, "ep": ep, "dp": expt_dp, "pp": pp})

    def dense_coords(self, rank: int) -> dict[str, int]:
        """Global `rank`'s dense grid coordinates ("tp", "cp", "dp", "pp"); its "pp" is its
        expert grid's too (the pipeline groups agree)."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is outside the grid's ranks {self.ranks}")
        index, coords = rank - self.offset, {}
        for name, size in self.dense_dims:
            index, coords[name] = divmod(index, size)
        return coords

    def sender_ranks(self) -> tuple[int, ...]:
        """The first rank of every (pp, ep) slice: one per PP stage, plus one per further EP
        rank of a stage. They hold every parameter between them (the reshard's senders)."""
        ranks = {self.expert_rank(ep=e, pp=p) for p in range(self.pp) for e in range(self.ep)}
        return tuple(sorted(ranks | {self.dense_rank(pp=p) for p in range(self.pp)}))


@dataclass(frozen=True)
class RoleWindow:
    """A contiguous range of global ranks shared by `roles`."""

    roles: tuple[str, ...]
    offset: int
    size: int

    @property
    def ranks(self) -> range:
        """The global ranks of this window."""
        return range(self.offset, self.offset + self.size)


@dataclass(frozen=True)
class RoleLayout:
    """Where every role runs. `parallelism` covers each placed Megatron role."""

    world_size: int
    windows: tuple[RoleWindow, ...]
    parallelism: dict[str, Parallelism]
    engine_tp_size: int = 1
    """Ranks per SGLang engine (recipe `engine.tp_size`): a host and tp_size - 1 followers."""
    ranks_per_node: int | None = None
    """Ranks on each node when known (torchrun's nproc-per-node); None: nodes not checked."""

    def window_of(self, role: str) -> RoleWindow:
        """The window `role` runs on."""
        for window in self.windows:
            if role in window.roles:
                return window
        raise ValueError(f"role {role!r} is not placed in this layout")

    def roles_of_rank(self, rank: int) -> tuple[str, ...]:
        """The roles global rank `rank` runs."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return next(w.roles for w in self.windows if rank in w.ranks)

    def rank_in_role(self, role: str, rank: int) -> int:
        """`rank`'s index inside `role`'s window (0 .. size-1)."""
        window = self.window_of(role)
        if rank not in window.ranks:
            raise ValueError(f"rank {rank} is not in role {role!r} (ranks {_span(window)})")
        return rank - window.offset

    def grid(self, role: str) -> RoleGrid:
        """The grid of Megatron role `role` on its window."""
        par, window = self.parallelism[role], self.window_of(role)
        dp = par.dp_for(window.size)
        return RoleGrid(window.offset, par.tp, par.pp, dp, par.cp, par.ep, par.etp, par.order)

    def dp_of(self, role: str) -> int:
        """Data-parallel size of a Megatron role."""
        return self.grid(role).dp

    def engine_host_ranks(self) -> tuple[int, ...]:
        """Global ranks that host an SGLang engine: every engine_tp_size-th generate rank."""
        if not any("generate" in w.roles for w in self.windows):
            return ()
        return tuple(self.window_of("generate").ranks[:: self.engine_tp_size])

    def is_engine_host(self, rank: int) -> bool:
        """Whether global rank `rank` hosts an engine (False for followers and other roles)."""
        return rank in self.engine_host_ranks()

    def is_engine_follower(self, rank: int) -> bool:
        """Whether `rank` is a generate rank that hosts no engine (it then holds no model)."""
        generate = [w for w in self.windows if "generate" in w.roles]
        return bool(generate) and rank in generate[0].ranks and not self.is_engine_host(rank)

    def engine_ranks(self, rank: int) -> range:
        """The global ranks of the engine generate rank `rank` belongs to (host first)."""
        host = self.window_of("generate").offset
        host += self.rank_in_role("generate", rank) // self.engine_tp_size * self.engine_tp_size
        return range(host, host + self.engine_tp_size)

    def describe(self) -> str:
        """A small table of windows, each Megatron role's sizes (edp: expert data parallel)
        and the engines, for logs and `--dry-run`."""
        rows = [("ranks", "role", "tp", "pp", "cp", "ep", "etp", "dp", "edp")]
        for window in self.windows:
            for role in window.roles:
                g = self.grid(role) if role in self.parallelism else None
                sizes = (g.tp, g.pp, g.cp, g.ep, g.etp, g.dp, g.expt_dp) if g else ("-",) * 7
                rows.append((_span(window), role, *map(str, sizes)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        for role, par in self.parallelism.items():
            if par.order != DEFAULT_ORDER:
                lines.append(f"{role}: ranks in order {par.order} (--use-tp-pp-dp-mapping)")
        hosts = self.engine_host_ranks()
        if hosts:
            size = self.engine_tp_size
            lines.append(
                f"engines: {len(hosts)} SGLang engine(s) of engine.tp_size {size} on generate "
                f"ranks {_span(self.window_of('generate'))}"
                + ("" if size == 1 else " (the host runs the engine; followers hold no model)")
            )
            for index, host in enumerate(hosts):
                members = _span(RoleWindow(("generate",), host, size))
                lines.append(f"  engine {index}: ranks {members}, host {host}")
        if self.ranks_per_node is not None:
            nodes = self.world_size // self.ranks_per_node
            lines.append(f"nodes: {nodes} x {self.ranks_per_node} ranks (no engine spans two)")
        return f"role layout over {self.world_size} ranks:\n" + "\n".join(lines)


def _span(window: RoleWindow) -> str:
    last = window.offset + window.size - 1
    return str(window.offset) if window.size == 1 else f"{window.offset}-{last}"


def _window_sizes(world_size: int, groups: list[RoleGroupSpec]) -> list[int]:
    """Rank counts per group: explicit counts, then ratios sharing what the counts leave."""
    counted = sum(g.num_ranks for g in groups if g.num_ranks is not None)
    ratio_groups = [i for i, g in enumerate(groups) if g.ratio is not None]
    if not ratio_groups:
        if counted != world_size:
            last = len(groups) - 1
            raise ConfigError(
                f"roles.groups[{last}].num_ranks",
                groups[last].num_ranks,
                f"rank counts must sum to the world size {world_size} (got {counted})",
                "change num_ranks, use ratio, or launch with a matching --nproc-per-node",
            )
        return [g.num_ranks for g in groups]
    ratios = [groups[i].ratio for i in ratio_groups]
    if abs(sum(ratios) - 1.0) > _TOLERANCE:
        raise ConfigError(
            "roles.groups[*].ratio",
            ratios,
            f"ratios must sum to 1 (got {sum(ratios):g})",
            "ratios share the ranks that num_ranks groups leave",
        )
    remainder = world_size - counted
    if remainder < len(ratio_groups):
        raise ConfigError(
            "roles.groups[*].num_ranks",
            counted,
            f"rank counts leave {remainder} of {world_size} ranks for {len(ratio_groups)} "
            "ratio groups (each needs >= 1)",
        )
    sizes = [g.num_ranks for g in groups]
    for index in ratio_groups:
        exact = groups[index].ratio * remainder
        if abs(exact - round(exact)) > _TOLERANCE or round(exact) < 1:
            raise ConfigError(
                f"roles.groups[{index}].ratio",
                groups[index].ratio,
                f"ratio * {remainder} ranks = {exact:g} is not a whole number >= 1 of ranks",
                "pick a ratio that splits the ranks evenly or use num_ranks",
            )
        sizes[index] = round(exact)
    return sizes


def _check_parallelism(role: str, par: Parallelism, window: RoleWindow, index: int) -> None:
    where = f"the {window.size}-rank window of roles.groups[{index}] (ranks {_span(window)})"
    key = f"roles.{role}.megatron"
    if window.size % par.model_size:
        if par.pp == par.cp == 1:
            key, value = f"{key}.tensor_model_parallel_size", par.tp
        else:
            value = f"tp={par.tp} pp={par.pp} cp={par.cp}"
        raise ConfigError(
            key,
            value,
            f"tp*pp*cp = {par.model_size} must divide {where}",
            f"use sizes whose product divides {window.size}, or resize the group",
        )
    # Same rule as megatron-core 0.16 `parallel_state.initialize_model_parallel`: the expert
    # grid etp*ep*pp must divide the (here: window) world size, i.e. (dp*tp*cp) % (ep*etp) == 0.
    expert_size = par.etp * par.ep * par.pp
    if window.size % expert_size:
        raise ConfigError(
            f"{key}.expert_model_parallel_size",
            f"ep={par.ep} etp={par.etp} pp={par.pp}",
            f"expert grid ep*etp*pp = {expert_size} must divide {where}",
        )
    if not par.pp_groups_agree:
        # megatron-core 0.16.1 `initialize_model_parallel` asserts it: with pp not the slowest
        # dimension, the attention and MoE layers must have the same data-parallel size.
        raise ConfigError(
            f"{key}.use_tp_pp_dp_mapping",
            True,
            f"the rank order {par.order} with pipeline_model_parallel_size {par.pp} > 1 needs "
            f"the expert grid's etp*ep = {par.etp}*{par.ep} to equal tp*cp = {par.tp}*{par.cp} "
            "(megatron-core: when pp is not the last dimension, the attention and MoE layers "
            "must have the same data-parallel size)",
            "set --expert-tensor-parallel-size so that etp*ep = tp*cp, or drop the flag",
        )


def _check_engines(window: RoleWindow, index: int, tp_size: int, ranks_per_node: int | None):
    where = (
        f"the {window.size}-rank generate window of roles.groups[{index}] (ranks {_span(window)})"
    )
    if window.size % tp_size:
        raise ConfigError(
            "engine.tp_size",
            tp_size,
            f"must divide {where}: each engine spans tp_size consecutive generate ranks",
            "resize the generate group or pick a tp_size that divides it",
        )
    if ranks_per_node is None:
        return
    for host in window.ranks[::tp_size]:
        last = host + tp_size - 1
        if host // ranks_per_node != last // ranks_per_node:
            raise ConfigError(
                "engine.tp_size",
                tp_size,
                f"the engine on ranks {host}-{last} of {where} straddles nodes of "
                f"{ranks_per_node} ranks (an engine's TP workers run on its host's node)",
                "start the generate window at a multiple of tp_size within a node, or pick a "
                f"tp_size dividing {ranks_per_node}",
            )


def plan_layout(
    world_size: int,
    groups: list[RoleGroupSpec],
    parallelism: dict[str, Parallelism],
    engine_tp_size: int = 1,
    ranks_per_node: int | None = None,
) -> RoleLayout:
    """Lay the role groups out over `world_size` ranks and check every Megatron role fits.

    A placed Megatron role missing from `parallelism` gets Parallelism(tp=1, pp=1). The generate
    window must split into engines of `engine_tp_size` ranks, none straddling two nodes when
    `ranks_per_node` is given.
    """
    require_int("world_size", world_size, 1)
    require_int("engine.tp_size", engine_tp_size, 1)
    require_int("ranks_per_node", ranks_per_node, 1, optional=True)
    if ranks_per_node is not None and world_size % ranks_per_node:
        raise ConfigError(
            "ranks_per_node",
            ranks_per_node,
            f"must divide the world size {world_size} (every node runs as many ranks)",
        )
    if not groups:
        raise ConfigError("roles.groups", groups, "must list at least one group")
    sizes = _window_sizes(world_size, groups)
    windows, offset = [], 0
    for group, size in zip(groups, sizes):
        windows.append(RoleWindow(tuple(group.roles), offset, size))
        offset += size
    assert offset == world_size, (offset, world_size)
    placed = {role: i for i, w in enumerate(windows) for role in w.roles}
    for role, par in parallelism.items():
        if role not in placed:
            raise ConfigError(f"roles.{role}", par, "has parallel sizes but is not placed")
    for role in MEGATRON_ROLES:
        if role in placed:
            par = parallelism.get(role, Parallelism(1, 1))
            _check_parallelism(role, par, windows[placed[role]], placed[role])
    if "generate" in placed:
        index = placed["generate"]
        _check_engines(windows[index], index, engine_tp_size, ranks_per_node)
    resolved = {r: parallelism.get(r, Parallelism(1, 1)) for r in MEGATRON_ROLES if r in placed}
    return RoleLayout(world_size, tuple(windows), resolved, engine_tp_size, ranks_per_node)
