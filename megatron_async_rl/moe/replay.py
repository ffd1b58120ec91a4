"""Routing replay inside one Megatron role: its routers use given experts, or record their own.

Owned here: `RoleRouting`, which puts one `RouterSlot` on every MoE router of a role's model
stage, sets each micro-batch's targets before its forward, counts agreement with the engine,
records what the routers chose, and `gather_recorded`, which assembles a role's recordings into
the batch layout (collective over the role's TP and PP groups). Called by
`roles.megatron_role.MegatronRole`; the data comes from `moe.routing`.

megatron-core 0.16 routes through `RouterReplay.get_replay_topk` when a router has a replay
object. Its own objects live in a class-level list driven by static methods, which would mix
the routers of roles sharing a rank (train, logp and ref on one window): a `RouterSlot` is
never put in that list, and each role drives only its own slots.

Token order: a router sees the stage's hidden states [S, b, H] flattened s-major (token
n = s * b + j), and under sequence parallelism only its TP rank's contiguous S / TP rows. A
forward re-run in the backward pass (activation recompute) replays the same micro-batch's
targets again, first in first out (the schedule's backward order is its forward order).

Shape suffixes: B samples, b micro-batch samples, S positions, L MoE layers, K experts, N tokens.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_async_rl.distributed import devices
from megatron_async_rl.moe.routing import same_topk_set


def _in_backward() -> bool:
    """Whether autograd's engine is running this code (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class RouterSlot(RouterReplay):
    """One MoE layer's replay object in one role (kept out of megatron's class-level list)."""

    def __init__(self, moe_index: int, noise: float = 0.0):  # noqa: D107 - not registered
        self.moe_index = moe_index
        self.noise = noise
        """faults.router_noise: the router's own choice is made on noisy scores."""
        """The layer's position among the model's MoE layers (the L axis of the data)."""
        self.target_topk_idx = self.recorded_topk_idx = self.router_replay_action = None
        self.replay_backward_list = []
        self.replay_NK: torch.Tensor | None = None
        """Experts to use for this micro-batch's tokens; None: route naturally."""
        self.compare_NK: torch.Tensor | None = None
        """Experts to compare the router's own choice with (agreement counts)."""
        self.valid_N: torch.Tensor | None = None
        self.record = False
        self.keep_for_backward = False
        """Keep each micro-batch's replayed experts for a forward recomputed in the backward
        pass (a train pass with activation recompute)."""
        self.recorded: list[torch.Tensor] = []
        """What the router chose (its own top-k), per micro-batch, when recording."""
        self.used: list[torch.Tensor] = []
        """What the layer used (replayed or its own), per micro-batch, when recording."""
        self.backward: deque[torch.Tensor] = deque()
        self.matched = self.used_matched = self.total = 0
        """Tokens whose own / used top-k set equals `compare_NK`'s, and tokens compared."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):  # fmt: skip
        if _in_backward():  # a recompute: the forward's choice again
            if self.backward:
                indices = self.backward.popleft().to(scores.device)
                return scores.gather(1, indices), indices
            if self.replay_NK is not None:
                raise RuntimeError(
                    f"routing replay, MoE layer {self.moe_index}: a forward recomputed in the "
                    "backward pass found no replayed experts kept for it"
                )
            return default_compute_topk(scores, topk, num_groups, group_topk)
        probs, own = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.noise:  # an induced mismatch (faults.router_noise): the choice only
            jitter = torch.randn_like(scores) * scores.std(dim=-1, keepdim=True) * self.noise
            _, own = default_compute_topk(scores + jitter, topk, num_groups, group_topk)
            probs = scores.gather(1, own)
        used = own
        if self.replay_NK is not None:
            used = self.replay_NK
            if self.valid_N is not None:  # tokens the engine did not route keep their own
                used = torch.where(self.valid_N[:, None], used, own)
            probs = scores.gather(1, used)
            if self.keep_for_backward:
                self.backward.append(used)
        if self.compare_NK is not None:  # tensors: no device sync per layer
            valid = self.valid_N if self.valid_N is not None else torch.ones_like(own[:, 0]).bool()
            self.matched = self.matched + (same_topk_set(own, self.compare_NK) & valid).sum()
            self.used_matched = self.used_matched + (same_topk_set(used, self.compare_NK)
                                                     & valid).sum()  # fmt: skip
            self.total = self.total + valid.sum()
        if self.record:
            self.recorded.append(own.detach())
            self.used.append(used.detach())
        return probs, used


class RoleRouting:
    """The replay slots of one role's model stage and the data each micro-batch needs."""

    def __init__(self, chunks, moe_layers: list[int], tp_group, sequence_parallel: bool,
                 noise: float = 0.0):  # fmt: skip
        """`chunks`: the stage's model chunks (a list, or one module): with virtual pipeline
        stages every chunk's routers get a slot, and `micro_batch` before a chunk's forward
        sets them all (only the chunk that runs reads its slots); `moe_layers`: the model's
        MoE layer numbers (0-based, global, in order); `noise`: `faults.router_noise`
        (`RouterSlot`)."""
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        position = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_moe_layers = len(moe_layers)
        self.slots: list[RouterSlot] = []
        for layer in (x for c in _as_list(chunks) for x in _decoder_layers(c)):
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is None:
                continue
            global_layer = layer.layer_number - 1
            if global_layer not in position:
                raise ValueError(
                    f"routing replay: layer {global_layer} has a router but is not among the "
                    f"model's MoE layers {moe_layers}"
                )
            slot = RouterSlot(position[global_layer], noise)
            router.router_replay = slot
            self.slots.append(slot)

    def __bool__(self) -> bool:
        return bool(self.slots)

    def _tokens(self, data_bSLK: torch.Tensor, index: int, device) -> torch.Tensor:
        """Layer `index` of the micro-batch in the router's token order, on `device`."""
        data_bSK = data_bSLK[:, :, index]
        if self.sequence_parallel:
            size, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
            data_bSK = data_bSK.chunk(size, dim=1)[rank]
        data_SbK = data_bSK.transpose(0, 1)
        return data_SbK.reshape(-1, *data_bSK.shape[2:]).to(device=device, dtype=torch.long)

    def micro_batch(self, *, replay_bSLK=None, compare_bSLK=None, valid_bS=None,
                    record: bool = False, keep_for_backward: bool = False,
                    device=None) -> None:  # fmt: skip
        """Set every slot for the next micro-batch's forward (before `model(...)`)."""
        for slot in self.slots:
            slot.keep_for_backward = keep_for_backward
            i = slot.moe_index
            slot.replay_NK = None if replay_bSLK is None else self._tokens(replay_bSLK, i, device)
            slot.compare_NK = (
                None if compare_bSLK is None else self._tokens(compare_bSLK, i, device)
            )
            slot.valid_N = (
                None if valid_bS is None
                else self._tokens(valid_bS[:, :, None, None], 0, device)[:, 0].bool()
            )  # fmt: skip
            slot.record = record

    def reset(self) -> None:
        """Forget every micro-batch (at the start of a pass)."""
        for slot in self.slots:
            slot.replay_NK = slot.compare_NK = slot.valid_N = None
            slot.record = slot.keep_for_backward = False
            slot.recorded, slot.used = [], []
            slot.backward.clear()
            slot.matched = slot.used_matched = slot.total = 0

    def take_counts(self) -> dict[int, tuple[int, int, int]]:
        """Per MoE layer of this stage: (tokens whose own top-k matched the comparison, tokens
        whose used top-k did, tokens compared)."""
        counts = {
            slot.moe_index: (int(slot.matched), int(slot.used_matched), int(slot.total))
            for slot in self.slots
        }
        for slot in self.slots:
            slot.matched = slot.used_matched = slot.total = 0
        return counts

    def take_recorded(self, micro_batch_size: int, used: bool = False) -> dict[int, torch.Tensor]:
        """Per MoE layer of this stage: [B, S_local, K] (this TP rank's rows under sequence
        parallelism) of the recorded micro-batches, in order; then forgotten."""
        out = {}
        for slot in self.slots:
            parts = slot.used if used else slot.recorded
            out[slot.moe_index] = torch.cat(
                [p.view(-1, micro_batch_size, p.shape[-1]).transpose(0, 1) for p in parts]
            ).cpu()
            slot.recorded, slot.used = [], []
        return out


def gather_recorded(routing: RoleRouting, recorded: dict[int, torch.Tensor], pp_group):
    """The whole role's recording as [B, S, L, K] on every rank of the role (collective over
    its TP group under sequence parallelism, then over its PP group)."""
    if routing.sequence_parallel:
        size = dist.get_world_size(routing.tp_group)
        for index, local in recorded.items():
            parts = [None] * size
            devices.all_gather_object(parts, local, group=routing.tp_group)
            recorded[index] = torch.cat(parts, dim=1)
    stages = [None] * dist.get_world_size(pp_group)
    devices.all_gather_object(stages, recorded, group=pp_group)
    merged = {index: data for stage in stages for index, data in stage.items()}
    if sorted(merged) != list(range(routing.num_moe_layers)):
        raise RuntimeError(
            f"routing replay: recorded MoE layers {sorted(merged)}, expected "
            f"0..{routing.num_moe_layers - 1}"
        )
    return torch.stack([merged[i] for i in range(routing.num_moe_layers)], dim=2)


def _as_list(chunks) -> list:
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def _decoder_layers(module):
    """The transformer layers of a GPT model's stage (through DDP/Float16 wrappers)."""
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    decoder = getattr(module, "decoder", None)
    return list(decoder.layers) if decoder is not None else []
