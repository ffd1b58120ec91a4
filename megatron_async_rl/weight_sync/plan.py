"""The reshard plan: which train ranks send which HF tensor ranges, in which buckets (pure).

Owned here: `build_plan`, a deterministic, cached function of (the train role's grid, model
dims, dtype, bucket sizes) to a frozen `ReshardPlan`. Called by `weight_sync.executor` on every
rank taking part in a sync (the same inputs give the same plan everywhere, so no plan crosses the
wire). The grid (`distributed.layout.RoleGrid`: global rank of every coordinate, and the sender
ranks the group builder also reads) is layout arithmetic and lives with the layout. Imports no
collective, no megatron, no sglang; split rules and names come from `models.names` (its pure
functions only).

    stage p, EP rank e:   sender = rank (tp 0, cp 0, dp 0, pp p) for dense parameters
                                   rank (etp 0, ep e, expt_dp 0, pp p) for experts of EP rank e
    sender's parameters -> Gather (TP / expert-TP group members, in TP-rank order) -> HF tensors
      -> pieces (flat element ranges) -> messages (<= consume bytes, header included)
      -> buckets (<= produce bytes): a sender fills one bucket buffer at a time, message by
         message (gather the parameters a message starts, pack it, put it on the wire).

Every PP stage and EP rank has its own sender, so stages send in parallel and no rank holds more
than its stage's parameters; with virtual pipeline stages a sender sends its model chunks in
turn (parameters named by `names.chunk_name`). A message is the unit of sending,
checksumming and loading; a tensor larger than a message is cut into pieces and reassembled by
the receiver. Ranks follow `ReshardPlan.schedule`, one global order of (sender, bucket), so
blocking collectives never wait on each other in a cycle. Grid orders are those of `RoleGrid`
(HyperCommGrid: tp fastest, pp slowest, or pp before dp with --use-tp-pp-dp-mapping; expert
grid etp, ep, expt_dp, pp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_async_rl.distributed.layout import RoleGrid
from megatron_async_rl.models.dims import ModelDims, expert_offset, hf_shape
from megatron_async_rl.models.names import (
    ShardSpec,
    chunk_name,
    hf_names_for,
    rank_global_name,
    shard_spec,
    stage_param_names,
    to_local_name,
)

HEADER_BYTES = 32
"""Per message: version, checksum, sender rank, sequence number (int64 each)."""
ALIGN_BYTES = 16
"""Pieces start on this boundary inside a message, so any dtype can view them."""
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


TrainLayout = RoleGrid
"""The plan's input: the train role's grid (`RoleLayout.grid("train")`), under the name callers
of the plan have used since before the grid moved to `distributed.layout`."""


@dataclass(frozen=True)
class Gather:
    """One Megatron parameter, assembled on its sender before its HF tensors are packed."""

    param: str
    """Global name (global layer and expert indices)."""
    local_name: str
    """The name in the state dict of every rank in `ranks` (stage-local, EP-local; its model
    chunk's `names.chunk_name` with virtual pipeline stages)."""
    spec: ShardSpec
    ranks: tuple[int, ...]
    """Global ranks holding its shards, in (expert-)TP rank order; `ranks[0]` is the sender."""
    group: str
    """The `ProcessGroupCollection` attribute all of `ranks` share: "tp" or "expt_tp"."""

    @property
    def is_collective(self) -> bool:
        return self.spec.partition_dim is not None and len(self.ranks) > 1


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened HF tensor `hf_name`, at `offset` in a payload."""

    hf_name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    offset: int
    source: str
    """The Megatron parameter it comes from (named in errors)."""

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == _numel(self.shape)


@dataclass(frozen=True)
class Message:
    """One consume chunk: sent, checksummed and loaded as a unit. Header, then payload."""

    pieces: tuple[Piece, ...]
    payload_bytes: int
    offset: int
    """Byte offset of the message (its header) in the bucket buffer."""
    gathers: tuple[Gather, ...] = ()
    """Parameters first needed in this message, in gather order (assembled before packing)."""
    releases: tuple[str, ...] = ()
    """Parameters whose last piece is in this message (the sender drops them after packing)."""

    @property
    def wire_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


@dataclass(frozen=True)
class Bucket:
    """What a sender gathers, packs and sends as one produce buffer."""

    messages: tuple[Message, ...]

    @property
    def gathers(self) -> tuple[Gather, ...]:
        return tuple(g for m in self.messages for g in m.gathers)

    @property
    def releases(self) -> tuple[str, ...]:
        return tuple(r for m in self.messages for r in m.releases)

    @property
    def nbytes(self) -> int:
        return sum(m.wire_bytes for m in self.messages)


@dataclass(frozen=True)
class SenderPlan:
    rank: int
    pp_rank: int
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class ReshardPlan:
    layout: RoleGrid
    dims: ModelDims
    dtype: str
    produce_bytes: int
    consume_bytes: int
    senders: tuple[SenderPlan, ...]
    hf_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Every HF tensor the engine expects, with its full shape, in model order."""

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.senders)

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """(sender index, bucket index), round-robin over senders: the one global order."""
        rounds = max((len(s.buckets) for s in self.senders), default=0)
        return tuple(
            (i, b) for b in range(rounds) for i, s in enumerate(self.senders) if b < len(s.buckets)
        )

    def params_of(self, rank: int) -> set[str]:
        """Local names of the parameters `rank` contributes (empty for ranks that only idle)."""
        return {
            g.local_name
            for s in self.senders
            for b in s.buckets
            for g in b.gathers
            if rank in g.ranks
        }


def check_stage_names(plan: ReshardPlan, rank: int, local_names, pp_rank: int, e0: int) -> None:
    """ValueError naming a parameter of `rank`'s model stage that the plan cannot map or lacks.

    `local_names` are the rank's state-dict names (`shards.rank_state_dict`: every model
    chunk's); `pp_rank` / `e0` its pipeline rank and expert offset.
    """
    for local in local_names:
        name = rank_global_name(
            local, plan.dims, pp_rank=pp_rank, pp_size=plan.layout.pp, expert_offset=e0
        )
        shard_spec(name, plan.dims)
    missing = sorted(plan.params_of(rank) - set(local_names))
    if missing:
        raise ValueError(
            f"weight sync: the reshard plan needs parameter {missing[0]!r} from global rank "
            f"{rank}, but its model stage has no such parameter ({len(missing)} missing)"
        )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _sender_gathers(layout: RoleGrid, dims: ModelDims) -> dict[int, list[Gather]]:
    """Sender rank -> the parameters it assembles, in model order."""
    out: dict[int, list[Gather]] = {}
    moe = dims.num_experts is not None
    chunks = dims.chunks(layout.pp)
    for p, v in ((p, v) for p in range(layout.pp) for v in chunks):  # a rank's chunks in order
        vp_stage = v if len(chunks) > 1 else None
        l0 = dims.stage_layers(p, layout.pp, vp_stage).start
        for e in range(layout.ep if moe else 1):
            e0 = expert_offset(e, layout.ep, dims.num_experts) if moe else 0
            names = stage_param_names(
                dims, pp_rank=p, pp_size=layout.pp, ep_rank=e, ep_size=layout.ep,
                vp_stage=vp_stage,
            )  # fmt: skip
            for name in names:
                spec = shard_spec(name, dims)
                if not hf_names_for(name, dims) or (e > 0 and not spec.is_expert):
                    continue  # the tied LM head copy; dense parameters come from EP rank 0
                if spec.is_expert:
                    size, group = layout.etp, "expt_tp"
                    ranks = [layout.expert_rank(etp=t, ep=e, pp=p) for t in range(size)]
                else:
                    size, group = layout.tp, "tp"
                    ranks = [layout.dense_rank(tp=t, pp=p) for t in range(size)]
                if spec.partition_dim is None:
                    ranks = ranks[:1]
                local = chunk_name(
                    to_local_name(name, layer_offset=l0, expert_offset=e0), v, len(chunks)
                )
                out.setdefault(ranks[0], []).append(Gather(name, local, spec, tuple(ranks), group))
    return out


class _Packer:
    """Greedy packing of pieces into messages (<= consume) and buckets (<= produce).

    `gathers` / `releases` belong to the message being filled.
    """

    def __init__(self, produce_bytes: int, consume_bytes: int):
        self.produce, self.payload_cap = produce_bytes, consume_bytes - HEADER_BYTES
        self.buckets: list[Bucket] = []
        self.messages: list[Message] = []
        self.pieces: list[Piece] = []
        self.payload = self.committed = 0
        self.gathers: list[Gather] = []
        self.releases: list[str] = []

    def add(self, first_of: Gather | None, hf_name, shape, start, stop, itemsize, source) -> None:
        """Place one piece; `first_of` is the parameter it starts (gathered for this message)."""
        nbytes = _align((stop - start) * itemsize)
        if self.pieces and self.payload + nbytes > self.payload_cap:
            self._close_message()
        open_bytes = HEADER_BYTES + self.payload if self.pieces else HEADER_BYTES
        if self.committed + open_bytes + nbytes > self.produce:
            self.close_bucket()
        if first_of is not None:
            self.gathers.append(first_of)
        self.pieces.append(Piece(hf_name, shape, start, stop, self.payload, source))
        self.payload += nbytes

    def _close_message(self) -> None:
        if self.pieces:
            message = Message(
                tuple(self.pieces),
                self.payload,
                self.committed,
                tuple(self.gathers),
                tuple(self.releases),
            )
            self.messages.append(message)
            self.committed += HEADER_BYTES + self.payload
            self.pieces, self.payload, self.gathers, self.releases = [], 0, [], []

    def close_bucket(self) -> None:
        self._close_message()
        if self.messages:
            self.buckets.append(Bucket(tuple(self.messages)))
            self.messages, self.committed = [], 0


@functools.lru_cache(maxsize=16)
def build_plan(
    layout: RoleGrid,
    dims: ModelDims,
    dtype: str = "float32",
    produce_bytes: int = 512 << 20,
    consume_bytes: int = 128 << 20,
) -> ReshardPlan:
    """The plan for moving a model of `dims` held in `layout` into HF-named engines."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"weight sync: parameter dtype {dtype!r} is not one of {list(ITEMSIZE)}")
    floor = HEADER_BYTES + 4 * ALIGN_BYTES
    for name, value in (("produce_bytes", produce_bytes), ("consume_bytes", consume_bytes)):
        if value < floor:
            raise ValueError(f"weight sync: {name} = {value} must be >= {floor}")
    itemsize = ITEMSIZE[dtype]
    max_piece = (min(consume_bytes, produce_bytes) - HEADER_BYTES) // ALIGN_BYTES * ALIGN_BYTES
    chunk = max_piece // itemsize
    senders = []
    for rank, gathers in sorted(_sender_gathers(layout, dims).items()):
        packer = _Packer(produce_bytes, consume_bytes)
        for gather in gathers:
            first = True
            for hf_name in hf_names_for(gather.param, dims):
                shape = hf_shape(hf_name, dims)
                numel = _numel(shape)
                for start in range(0, numel, chunk):
                    packer.add(
                        gather if first else None,
                        hf_name,
                        shape,
                        start,
                        min(start + chunk, numel),
                        itemsize,
                        gather.param,
                    )
                    first = False
            packer.releases.append(gather.param)
        packer.close_bucket()
        pp_rank = layout.dense_coords(rank)["pp"]
        senders.append(SenderPlan(rank, pp_rank, tuple(packer.buckets)))
    shapes = tuple(
        (hf, hf_shape(hf, dims))
        for name in stage_param_names(dims)
        for hf in hf_names_for(name, dims)
    )
    return ReshardPlan(layout, dims, dtype, produce_bytes, consume_bytes, tuple(senders), shapes)
