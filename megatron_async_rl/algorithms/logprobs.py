"""Per-token log-probs and entropy from vocab-parallel logits, over the role's own TP group.

Owned here: the one function every role uses to turn logits into log-probs (logp, ref, train,
and the engine-vs-train check). Called by `roles.megatron_role` on the last pipeline stage.
Megatron's `vocab_parallel_cross_entropy` reads the global TP group (facts: leak 2), so this
module takes the group as an argument. It is differentiable: sums over the vocab shards go
through Megatron's `reduce_from_tensor_model_parallel_region` (forward all-reduce, backward
identity), which is right because every TP rank then computes the same, replicated loss; an
all-reduce in backward would scale gradients by the TP size.

Shapes: B batch, T positions, V_local = this rank's vocab shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(tensor, group=group)


def vocab_parallel_logprobs(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    tp_group,
    vocab_size: int,
    with_entropy: bool = True,
    fp32: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token and the entropy of each position's distribution.

    `logits_BTV` is this TP rank's contiguous vocab shard (rank r holds ids
    [r * V_local, (r + 1) * V_local)). Ids >= `vocab_size` are Megatron's vocab padding and are
    excluded from the softmax. Computed in fp32 whatever the logits dtype; with `fp32=False`
    (--fp16-lm-cross-entropy) in the logits' own dtype, which saves the fp32 copy of the
    [B, T, V_local] logits at the cost of precision (results are returned in fp32 either way).
    """
    logits = logits_BTV.float() if fp32 else logits_BTV
    v_local = logits.shape[-1]
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = tp_rank * v_local
    num_real = max(0, min(v_local, vocab_size - start))
    if num_real < v_local:
        pad = torch.zeros(v_local, dtype=torch.bool, device=logits.device)
        pad[num_real:] = True
        logits = logits.masked_fill(pad, float("-inf"))

    local_max = logits.max(dim=-1).values.detach()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _sum(exp.sum(dim=-1), tp_group)
    log_z = sum_exp.log()

    local_ids = targets_BT - start
    in_shard = (local_ids >= 0) & (local_ids < v_local)
    picked = shifted.gather(-1, local_ids.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum(torch.where(in_shard, picked, torch.zeros_like(picked)), tp_group)
    logp = target_logit - log_z

    entropy = None
    if with_entropy:
        # H = log Z - E_p[z]; padded ids have exp = 0 and contribute nothing.
        p_times_z = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
        entropy = (log_z - _sum(p_times_z, tp_group) / sum_exp).float()
    return logp.float(), entropy
