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
    # Rows as Python lists, one tensor each at the end: a step's 128 short samples took ~20 ms
    # as per-sample tensor slices, on the learn side's critical path.
    tokens, mask, behaviour, versions = [], [], [], []
    for s, length in zip(samples, lengths):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens.append([*s.prompt_ids, *s.response_ids, *[pad_id] * (seq_len - length)])
        # response token j sits at position p + j and is predicted by column p + j - 1
        # (a multi-turn trajectory's environment tokens are not trained: mask 0)
        before, after = [0] * (p - 1), [0] * (seq_len - p - r)
        trained = s.loss_mask if s.loss_mask is not None else [1] * r
        mask.append([*before, *trained, *after])
        behaviour.append([*before, *s.response_logprobs, *after])
        # "" (an environment's token): version 0, masked
        versions.append([*before, *(version_number(v) for v in s.token_versions), *after])
    routing, routing_valid = _routing(samples, seq_len)
    return {
        "routing": routing,
        "routing_valid": routing_valid,
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "mask": torch.tensor(mask, dtype=torch.get_default_dtype()),
        "behaviour_logp": torch.tensor(behaviour, dtype=torch.get_default_dtype()),
        "versions": torch.tensor(versions, dtype=torch.long),
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
