"""The actor's multi-token-prediction (MTP) targets and cross-entropy (--mtp-num-layers N).

Owned here: `MTPLossLog`, which gives each micro-batch of a train step its loss hook (the
targets of every MTP layer and the cross-entropy of that layer's logits against them) and
reduces what the hooks recorded into the step's metrics. Called by `roles.megatron_role`
(`train_step`), which passes the hook to `compat.megatron_mtp.loss_hook`; the scaling by
mtp_loss_scaling_factor / N and the backward are megatron-core's (`MTPLossAutoScaler`), there.

Targets, as megatron-core 0.16.1 builds them (its labels are the next tokens, rolled once more
per MTP layer): MTP layer k (0-based) at position t has read tokens up to t + k + 1 (the main
decoder up to t, then one more embedded token per layer) and predicts token t + k + 2. It is
counted where that token is real, not padding: every sample's prompt and response tokens, as
Megatron-LM pretrains MTP on every token (its loss mask), whatever the RL loss mask says.
The cross-entropy is over the real vocabulary (`algorithms.logprobs`; Megatron's vocab padding
is left out, as for the RL log-probs).

Metrics: `actor/mtp_loss`, the mean over MTP layers of each layer's cross-entropy (unscaled),
each a mean over the counted tokens of a micro-batch, averaged over micro-batches and
data-parallel ranks (as Megatron-LM's `MTPLossLoggingHelper` averages it); with N > 1 also
`actor/mtp_<k+1>_loss` per layer.

Shapes: b micro-batch rows, T positions; s, b, v megatron-core's [sequence, batch, vocab shard].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_async_rl.algorithms.logprobs import vocab_parallel_logprobs


def layer_targets(tokens_bT: Tensor, padding_bT: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(targets_bT, counted_bT) of MTP layer k: tokens[:, t + k + 2] where that token exists
    and is not padding (counted True), 0 and False elsewhere."""
    shift = k + 2
    targets_bT = torch.zeros_like(tokens_bT)
    counted_bT = torch.zeros_like(padding_bT, dtype=torch.bool)
    if shift < tokens_bT.shape[1]:
        targets_bT[:, :-shift] = tokens_bT[:, shift:]
        counted_bT[:, :-shift] = ~padding_bT[:, shift:].bool()
    return targets_bT, counted_bT


class MTPLossLog:
    """One train step's MTP losses: `hook` per micro-batch, `metrics` at the end."""

    def __init__(self, num_layers: int, *, tp_group, vocab_size: int, fp32: bool = True):
        self.num_layers = num_layers
        self.tp_group, self.vocab_size, self.fp32 = tp_group, vocab_size, fp32
        self.means: list[list[Tensor]] = [[] for _ in range(num_layers)]
        """Per layer, each micro-batch's [mean cross-entropy over its counted tokens, 1], or
        [0, 0] for a micro-batch that counted none (detached; read once, in `metrics`)."""

    @classmethod
    def for_step(cls, role, micro_batches: list[dict]) -> MTPLossLog | None:
        """The log of a train step of `role` (a `MegatronRole`) with --mtp-num-layers, else
        None; its micro-batches must carry `padding` (the MTP targets are the real tokens)."""
        if not role.mtp_num_layers:
            return None
        if any(mb.get("padding") is None for mb in micro_batches):
            raise RuntimeError(
                f"role {role.role} (global rank {dist.get_rank()}): --mtp-num-layers trains on "
                "the real tokens, and a micro-batch has no `padding` (bool [b, T], True at pads)"
            )
        return cls(role.mtp_num_layers, tp_group=role.pgc.tp, vocab_size=role.spec.vocab_size,
                   fp32=role.logprobs_in_fp32)  # fmt: skip

    def hook(self, tokens_bT: Tensor, padding_bT: Tensor) -> Callable:
        """The loss hook of one micro-batch (`compat.megatron_mtp.loss_hook`):
        (k, logits_sbv) -> (cross-entropy sum over the counted tokens, their count)."""

        def loss(k: int, logits_sbv: Tensor) -> tuple[Tensor, Tensor]:
            targets_bT, counted_bT = layer_targets(tokens_bT, padding_bT, k)
            logp_bT, _ = vocab_parallel_logprobs(
                logits_sbv.transpose(0, 1), targets_bT, tp_group=self.tp_group,
                vocab_size=self.vocab_size, with_entropy=False, fp32=self.fp32,
            )  # fmt: skip
            ce_sum = -(logp_bT * counted_bT).sum()
            num_tokens = counted_bT.sum()
            counted = (num_tokens > 0).to(torch.float64)
            mean = ce_sum.detach().to(torch.float64) / num_tokens.clamp(min=1)
            self.means[k].append(torch.stack([mean, counted]))
            return ce_sum, num_tokens

        return loss

    def metrics(self, dp_group, device, pp_group=None) -> dict[str, float]:
        """`actor/mtp_loss` (and per layer with several), averaged over the micro-batches that
        counted tokens and over the data-parallel ranks (collective over `dp_group`, then over
        `pp_group` where given: the last stage's losses, the others' none, so that every rank
        of the role reports the same; `device`: where their backend reduces)."""
        totals = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=device)
        for k, records in enumerate(self.means):
            if records:
                totals[k] = torch.stack(records).to(device).sum(dim=0)
        for group in (dp_group, pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        per_layer = (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()
        out = {"actor/mtp_loss": sum(per_layer) / len(per_layer)}
        if len(per_layer) > 1:
            out.update({f"actor/mtp_{k + 1}_loss": v for k, v in enumerate(per_layer)})
        return out
