"""The CPU engine's attention: SGLang's torch-native backend, one SDPA call per group of requests.

SGLang's `TorchNativeAttnBackend` (the CPU engine's backend, `host.CPU_ATTENTION_BACKEND`) loops
over the requests of a batch and calls `scaled_dot_product_attention` once per request and
layer. On the quick start (128 requests, 2 layers, hidden 64) that loop is about 40% of the
scheduler's time in a generate call (profiled with py-spy; `benchmarks/engine_generate.py`
times it). This subclass groups the batch's requests by length (in decode, the sequence length; in
extend, the sequence and cached-prefix lengths), gathers each group's keys and values from the
KV cache, and calls SDPA once per group and layer, with the loop's shapes and layouts batched:
one call for a batch of equal-length prompts, as RL batches mostly are (a step's prompts of one
template, sampled together).

Everything else is SGLang's: the KV-cache writes, the pools, the metadata. Batches it does not
cover (encoder-decoder, cross-attention, sliding windows) go to the upstream per-request loop.

Numerics: no padding and no mask, so each request's attention is computed as the loop computes
it, bit for bit (`tests/unit/test_batched_attention.py` asserts equality with SGLang's loop on
the same cache): a request's log-probs still do not depend on what else is in its batch, and a
run is unchanged at the same seed. A padded, masked single call was tried first: it changed the
last bits with the batch's longest request, which can flip a sampled token between runs whose
batches differ (suspected in a failure of the two-host test, whose runs batch validation
requests differently).

Installed in the engine's processes by `cpu_shims/sitecustomize.py`, which registers it under
SGLang's own name `torch_native` in SGLang's attention-backend registry, unless the engine
host sets `host.CPU_ATTENTION_ENV` to `per_request` (`engine.cpu_attention: per_request`),
which keeps SGLang's loop.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention


def _groups(*keys: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The batch's requests grouped by equal `keys` (e.g. sequence lengths): [(key values,
    indices of the requests that have them)], in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, key in enumerate(zip(*(k.tolist() for k in keys))):
        groups.setdefault(key, []).append(index)
    return [(key, torch.tensor(members)) for key, members in groups.items()]


def _gathered(cache: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[G, L] cache slots -> [G, heads, L, dim] (the loop's layout, a batch of them)."""
    return cache[tokens].permute(0, 2, 1, 3)


def _covered(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    return encoder_lens is None and not is_cross_attn and (
        sliding_window_size is None or sliding_window_size < 0)  # fmt: skip


class BatchedTorchNativeAttnBackend(TorchNativeAttnBackend):
    """`TorchNativeAttnBackend` with one SDPA call per group of equal-length requests."""

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token,
                                 req_pool_indices, seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False,
                                 sliding_window_size=None):  # fmt: skip
        if not _covered(encoder_lens, is_cross_attn, sliding_window_size):
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        # query: [requests, heads, dim], one token a request
        for (length,), members in _groups(seq_lens):
            tokens = req_to_token[req_pool_indices[members], :length]
            key, value = _gathered(k_cache, tokens), _gathered(v_cache, tokens)
            q = query[members].unsqueeze(2)  # [G, heads, 1, dim]
            key, value = key.to(q.dtype), value.to(q.dtype)
            out = scaled_dot_product_attention(q, key, value, enable_gqa=enable_gqa,
                                               scale=scaling, is_causal=causal)  # fmt: skip
            output[members] = out.squeeze(2)
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
        # query: [new tokens of every request, in order, heads, dim]
        starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
        heads, dim = query.shape[1], query.shape[2]
        for (length, prefix), members in _groups(seq_lens, extend_prefix_lens):
            new = length - prefix
            rows = (starts[members][:, None] + torch.arange(new)[None, :]).reshape(-1)
            # as the loop does: the new tokens' queries at their positions of a whole-length
            # query, the cached prefix's rows left unset (computed, then dropped)
            q = query.new_empty((len(members), heads, length, dim))
            q[:, :, prefix:, :] = query[rows].view(len(members), new, heads, dim).transpose(1, 2)
            tokens = req_to_token[req_pool_indices[members], :length]
            key, value = _gathered(k_cache, tokens), _gathered(v_cache, tokens)
            key, value = key.to(q.dtype), value.to(q.dtype)
            out = scaled_dot_product_attention(q, key, value, enable_gqa=enable_gqa,
                                               scale=scaling, is_causal=causal)  # fmt: skip
            output[rows] = out[:, :, prefix:, :].transpose(1, 2).reshape(-1, heads, out.shape[-1])
        return output
