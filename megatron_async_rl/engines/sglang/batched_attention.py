"""The CPU engine's attention: SGLang's torch-native backend, one SDPA call per layer for the batch.

SGLang's `TorchNativeAttnBackend` (the CPU engine's backend, `host.CPU_ATTENTION_BACKEND`) loops
over the requests of a batch and calls `scaled_dot_product_attention` once per request and
layer. On the quick start (128 requests, 2 layers, hidden 64) that loop is about 40% of the
scheduler's time in a generate call (profiled with py-spy; `benchmarks/engine_generate.py`
times it). This subclass gathers the batch's keys and values from the KV cache into one padded
tensor, masks each request's padding, and calls SDPA once: for decode (one query a request) and
for extend (each request's new tokens attend causally to its cached prefix and to each other).

Everything else is SGLang's: the KV-cache writes, the pools, the metadata. Batches it does not
cover (encoder-decoder, cross-attention, sliding windows) go to the upstream per-request loop.
Padding points at the request's first cached token, so masked positions read finite values.

Numerics: the same products and sums as the loop, with masked positions adding exact zeros; the
order of a reduction may differ in the last bits with the batch's longest request (like the
GPU backends', a request's log-probs are not bit-independent of its batch). Checked against the
loop and `transformers` by `tests/distributed/test_sglang_engine.py` and
`tests/unit/test_batched_attention.py`.

Installed in the engine's processes by `cpu_shims/sitecustomize.py`, which registers it under
SGLang's own name `torch_native` in SGLang's attention-backend registry, unless the engine
host sets `host.CPU_ATTENTION_ENV` to `per_request` (`engine.cpu_attention: per_request`),
which keeps SGLang's loop.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

def _gathered(cache: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, L] cache slots -> [B, heads, L, dim]."""
    return cache[tokens].permute(0, 2, 1, 3)


def _padded_slots(req_to_token, req_pool_indices, seq_lens):
    """Each request's KV-cache slots, padded to the longest with its first slot; and the mask
    [B, L] of real positions."""
    longest = int(seq_lens.max())
    slots = req_to_token[req_pool_indices, :longest]
    real = torch.arange(longest, device=seq_lens.device)[None, :] < seq_lens[:, None]
    return torch.where(real, slots, slots[:, :1]), real


def _covered(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    return encoder_lens is None and not is_cross_attn and (
        sliding_window_size is None or sliding_window_size < 0)  # fmt: skip


class BatchedTorchNativeAttnBackend(TorchNativeAttnBackend):
    """`TorchNativeAttnBackend` with one SDPA call per layer for the whole batch."""

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token,
                                 req_pool_indices, seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False,
                                 sliding_window_size=None):  # fmt: skip
        if not _covered(encoder_lens, is_cross_attn, sliding_window_size):
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        slots, real = _padded_slots(req_to_token, req_pool_indices, seq_lens)
        key, value = _gathered(k_cache, slots), _gathered(v_cache, slots)
        q = query.unsqueeze(2)  # [B, heads, 1, dim]
        key, value = key.to(q.dtype), value.to(q.dtype)
        out = scaled_dot_product_attention(q, key, value, attn_mask=real[:, None, None, :],
                                           enable_gqa=enable_gqa, scale=scaling)  # fmt: skip
        output.copy_(out.squeeze(2))
        return output

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token,
                                 req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                                 is_cross_attn=False, sliding_window_size=None):  # fmt: skip
        if not _covered(encoder_lens, is_cross_attn, sliding_window_size):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                is_cross_attn, sliding_window_size)
        batch = seq_lens.shape[0]
        slots, real = _padded_slots(req_to_token, req_pool_indices, seq_lens)
        key, value = _gathered(k_cache, slots), _gathered(v_cache, slots)
        # the new tokens of request b are rows [starts[b], starts[b] + extend_seq_lens[b]) of
        # `query`; padded to [B, longest extend, heads, dim]
        new = int(extend_seq_lens.max())
        starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
        offset = torch.arange(new, device=query.device)
        is_new = offset[None, :] < extend_seq_lens[:, None]  # [B, new]
        rows = torch.where(is_new, starts[:, None] + offset[None, :], starts[:, None])
        q = query[rows].permute(0, 2, 1, 3)  # [B, heads, new, dim]
        mask = real[:, None, :].expand(batch, new, -1)  # [B, new, longest]
        if causal:  # query i of request b sits at position prefix_b + i
            positions = extend_prefix_lens[:, None] + offset[None, :]
            kv = torch.arange(slots.shape[1], device=query.device)
            mask = mask & (kv[None, None, :] <= positions[:, :, None])
        key, value = key.to(q.dtype), value.to(q.dtype)
        out = scaled_dot_product_attention(q, key, value, attn_mask=mask[:, None],
                                           enable_gqa=enable_gqa, scale=scaling)  # fmt: skip
        output[rows[is_new]] = out.permute(0, 2, 1, 3)[is_new]
        return output
