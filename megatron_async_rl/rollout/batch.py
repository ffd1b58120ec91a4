"""Samples to training tensors: right-padded tokens and per-token masks aligned to log-probs.

Owned here: the layout every Megatron role and the loss read. Called by the jobs after the
samples of a step are gathered. Column t of every [B, T-1] tensor describes the prediction of
tokens[:, t + 1], the convention of `algorithms.logprobs`.

Shapes: B samples, T = longest prompt + response of the step (rounded up to `multiple`).
"""

from __future__ import annotations

import torch

from megatron_async_rl.engines.protocol import version_number
from megatron_async_rl.moe.routing import routing_batch


def build_batch(samples, pad_id: int, multiple: int = 8) -> dict[str, torch.Tensor]:
    """tokens_BT, mask_BT1 (trained response tokens), behaviour_logp_BT1, version_BT1, rewards_B,
    response_len_B, prompt_len_B; MoE samples with the engine's experts also routing_BTLK and
    routing_valid_BT (`moe.routing.routing_batch`; else None)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len = -(-max(lengths) // multiple) * multiple
    batch_size = len(samples)
    tokens = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(batch_size, seq_len - 1)
    behaviour = torch.zeros(batch_size, seq_len - 1)
    versions = torch.zeros(batch_size, seq_len - 1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p] = torch.tensor(s.prompt_ids)
        if r:
            tokens[i, p : p + r] = torch.tensor(s.response_ids)
            # response token j sits at position p + j and is predicted by column p + j - 1
            # (a multi-turn trajectory's environment tokens are not trained: mask 0)
            trained = s.loss_mask if s.loss_mask is not None else [1.0] * r
            mask[i, p - 1 : p - 1 + r] = torch.tensor(trained, dtype=mask.dtype)
            behaviour[i, p - 1 : p - 1 + r] = torch.tensor(s.response_logprobs)
            versions[i, p - 1 : p - 1 + r] = torch.tensor(
                [version_number(v) for v in s.token_versions]  # "" (environment): 0, masked
            )
    routing, routing_valid = _routing(samples, seq_len)
    return {
        "routing": routing,
        "routing_valid": routing_valid,
        "tokens": tokens,
        "mask": mask,
        "behaviour_logp": behaviour,
        "versions": versions,
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "response_len": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32),
        "prompt_len": torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float32),
    }


def padding_BT(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool [B, T], True at the pad positions after each sample's prompt and response: the
    MoE routers' padding mask (megatron-core leaves them out of the auxiliary losses)."""
    lengths = (batch["prompt_len"] + batch["response_len"]).long()
    return torch.arange(batch["tokens"].shape[1])[None, :] >= lengths[:, None]


def _routing(samples, seq_len: int):
    first = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    if first is None:
        return None, None
    return routing_batch(samples, seq_len, *first.shape[1:])
