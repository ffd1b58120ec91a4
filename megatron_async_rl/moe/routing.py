"""Routed experts as data: the engine's per-token top-k, compact, and laid out as a batch.

Owned here (pure: numpy and torch, no collectives, no Megatron): the compact dtype of expert
ids, decoding SGLang's `routed_experts` payload, the batch tensor the Megatron roles replay
(`routing_batch`), and top-k set agreement. The engine host decodes (`engines.sglang.host`),
the sample carries the array (`rollout.generation.Sample.routed_experts`), `rollout.batch` lays
it out, `moe.replay` replays it.

A sample's routing has one row per token the engine took as input, prompt and response alike:
rows 0 .. P + R - 2 for a prompt of P and a response of R tokens (the last response token is
never an input), each row [L, k] with L the model's MoE layers in order (dense layers are left
out) and k the experts per token. Row t is position t of the trainer's forward pass.

Shape suffixes: B samples, T positions, L MoE layers, K experts per token, N tokens.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
import torch


def compact_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype that holds every expert id: uint8 up to 256 experts, else int16."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def decode_engine_routing(
    payload, num_layers: int, topk: int, layers: Sequence[int], num_experts: int
) -> torch.Tensor:
    """SGLang's `meta_info["routed_experts"]` (base64 of int32 [rows, num_layers, topk], or
    the array) to [rows, len(layers), topk] in `compact_dtype`, keeping the MoE `layers`.
    A tensor, not a numpy array: samples are saved with `torch.save(weights_only)`."""
    if isinstance(payload, str):
        flat = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    else:
        flat = np.asarray(payload, dtype=np.int32).reshape(-1)
    per_row = num_layers * topk
    if flat.size % per_row:
        raise ValueError(
            f"routed experts: {flat.size} ids do not split into rows of {num_layers} layers x "
            f"{topk} experts; the engine's model differs from the one the trainer expects"
        )
    full = flat.reshape(-1, num_layers, topk)[:, list(layers), :]
    if full.size and (full.min() < 0 or full.max() >= num_experts):
        raise ValueError(
            f"routed experts: ids in [{full.min()}, {full.max()}] outside [0, {num_experts})"
        )
    return torch.from_numpy(np.ascontiguousarray(full)).to(compact_dtype(num_experts))


def routing_batch(samples, seq_len: int, num_layers: int, topk: int):
    """(routing_BTLK, valid_BT) for `rollout.batch.build_batch`'s layout, or (None, None)
    when no sample carries routing.

    Row t of sample i is position t, valid where the engine routed it. Rows it did not route
    (the last response token, padding, a sample whose engine returned no routing: a response
    continued from a prefix its dead engine reported) hold experts 0..K-1 and valid False: the
    replaying router uses its own choice there.
    """
    carrying = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not carrying:
        return None, None
    dtype = carrying[0].dtype
    out = torch.arange(topk, dtype=dtype).expand(len(samples), seq_len, num_layers, topk)
    out = out.clone()
    valid = torch.zeros(len(samples), seq_len, dtype=torch.bool)
    for i, s in enumerate(samples):
        got = s.routed_experts
        if got is None:
            continue
        rows = len(s.prompt_ids) + len(s.response_ids) - 1
        if tuple(got.shape) != (rows, num_layers, topk):
            raise ValueError(
                f"sample {s.uid}: routed experts of shape {tuple(got.shape)}, expected "
                f"({rows}, {num_layers}, {topk}) (one row per input token: prompt + response "
                "- 1; MoE layers; experts per token)"
            )
        out[i, :rows] = got
        valid[i, :rows] = True
    return out, valid


def same_topk_set(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """Per token, whether both chose the same set of experts (order ignored)."""
    return (a_NK.sort(dim=-1).values == b_NK.to(a_NK.dtype).sort(dim=-1).values).all(dim=-1)


def routing_bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """The routing data one token carries from engine to trainer."""
    return num_layers * topk * compact_dtype(num_experts).itemsize


def routing_counts(counts: dict[int, tuple[int, int, int]]) -> dict[str, float]:
    """A pass's per-layer (own matched, used matched, compared) token counts as summable
    report entries."""
    out = {}
    for layer, (matched, used, total) in counts.items():
        out[f"moe/routing_matched/layer_{layer}"] = float(matched)
        out[f"moe/routing_used_matched/layer_{layer}"] = float(used)
        out[f"moe/routing_tokens/layer_{layer}"] = float(total)
    return out


def agreement_metrics(sums: dict[str, float]) -> dict[str, float]:
    """From the step's summed `routing_counts`: `moe/routing_agreement/layer_<i>`, the share of
    compared tokens whose trainer top-k set (the router's own choice) equals the engine's, and
    `moe/routing_agreement` its mean over layers; `moe/replay_agreement`, the same for the
    experts the layers used (1.0 when replay reached every token); `moe/routing_tokens`, the
    tokens compared per layer."""
    out = {}
    layers = sorted(
        int(k.rsplit("_", 1)[1]) for k in sums if k.startswith("moe/routing_tokens/layer_")
    )
    own, used = [], []
    for layer in layers:
        total = sums[f"moe/routing_tokens/layer_{layer}"]
        if total:
            share = sums.get(f"moe/routing_matched/layer_{layer}", 0.0) / total
            out[f"moe/routing_agreement/layer_{layer}"] = share
            own.append(share)
            used.append(sums.get(f"moe/routing_used_matched/layer_{layer}", 0.0) / total)
    if own:
        out["moe/routing_agreement"] = sum(own) / len(own)
        out["moe/replay_agreement"] = sum(used) / len(used)
        out["moe/routing_tokens"] = sums[f"moe/routing_tokens/layer_{layers[0]}"]
    return out
