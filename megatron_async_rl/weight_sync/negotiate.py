"""How each sender's messages travel in one weight sync, agreed by its group at the start.

Owned here: `negotiate`, called by `weight_sync.executor.run_plan` on every participant before
the schedule runs. Per sender, over its group: shared memory when every receiver runs on the
sender's host and maps its produce slots (only headers then go on the wire), else the broadcast
of whole messages; with delta bases (`weight_sync.delta`), that broadcast goes through the delta
codec (`weight_sync.delta_wire`), carrying deltas when every member holds the base version the
sender proposes, and whole messages otherwise.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_async_rl.distributed import devices
from megatron_async_rl.weight_sync import buffers
from megatron_async_rl.weight_sync.delta_wire import DeltaCodec

logger = logging.getLogger(__name__)


def negotiate(plan, rank, sender_groups, sender_state, receiver, transport, stats, device,
              bases=None):  # fmt: skip
    """Per sender (in plan order, over its group): shared memory if the sender offers its slots
    and every receiver maps them, else the broadcast of whole messages; then, with `bases`
    (`weight_sync.delta`), the broadcast goes through the delta codec, and carries deltas when
    every member of the group holds the version the sender proposes (`DeltaBases.proposal`).
    Collective (on the host bridge; the device bridge always broadcasts whole messages, and
    negotiates nothing)."""
    if device.type != "cpu":
        return
    for sender in plan.senders:
        group = sender_groups.get(sender.rank)
        if group is None or dist.get_world_size(group) == 1:
            continue
        box: list = [None]
        if sender.rank == rank:
            handles = None
            if transport != "broadcast":
                handles = sender_state.offer_shared_memory(len(sender.buckets))
            proposal = bases.proposal(rank) if bases is not None else None
            box = [(handles, proposal, bases is not None)]
        devices.broadcast_object_list(box, src=sender.rank, group=group)
        handles, proposal, encoded = box[0]
        problem = "the sender offers none" if handles is None else None
        if handles is not None and receiver is not None and sender.rank != rank:
            try:
                receiver.shared_memory.attach(sender.rank, handles)
            except OSError as exc:
                problem = f"receiver global rank {rank} cannot map them: {exc}"
        holds = proposal is not None and bases is not None and bases.held(sender.rank) == proposal
        # (members with a problem, members without the base): one all_reduce, not an object
        # gather (two collectives and pickling, every sync); the problems' text only when one
        # keeps shared memory from a sender that offered it, for the sender's log
        counts = torch.tensor([problem is not None, not holds], dtype=torch.int64)
        dist.all_reduce(counts, group=group)
        if not counts[0]:
            if sender.rank == rank:
                sender_state.use_shared_memory()
            stats.shared_memory_senders += 1
            continue
        if receiver is not None:
            receiver.shared_memory.detach(sender.rank)
        if transport == "auto" and handles is not None:  # the same on every member
            problems = [None] * dist.get_world_size(group)
            devices.all_gather_object(problems, problem, group=group)
            if rank == sender.rank:
                logger.info(
                    "weight sync: sender global rank %d broadcasts whole messages: %s",
                    sender.rank, next(p for p in problems if p),
                )  # fmt: skip
        if encoded:
            deltas = not counts[1]
            width = buffers.torch_dtype(plan.dtype).itemsize
            codec = DeltaCodec(bases, sender.rank, deltas, width, stats)
            if sender.rank == rank:
                sender_state.use_codec(codec)
            elif receiver is not None:
                receiver.use_codec(codec)
            stats.delta_senders += deltas
            stats.full_senders += not deltas
