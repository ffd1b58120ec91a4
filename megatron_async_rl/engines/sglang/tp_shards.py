"""A whole HF-named tensor from the slices SGLang's TP ranks hold (pure: torch only).

Owned here: `assemble_hf_tensor`, which the engine host (`engines/sglang/host.py`) uses to read
back a weight of a TP > 1 engine as the trainer sent it, from each TP rank's parameter in
SGLang's naming and layout (fused projections, split input dims, padded vocab rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Llama-family HF projections that SGLang fuses per TP rank: HF name part -> (SGLang name part,
# position inside the fused rows).
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")  # input dim split across TP ranks
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")  # vocab rows split, padded


def assemble_hf_tensor(
    name: str,
    read: Callable[[int, str], torch.Tensor | None],
    tp_size: int,
    hf_config: dict[str, Any],
) -> torch.Tensor:
    """The full HF-named tensor `name` (float32) from SGLang's per-TP-rank parameters.

    `read(rank, sglang_name)` returns TP rank `rank`'s parameter or None. Layouts are those of
    SGLang's Llama-family models (Llama, Qwen2): each rank's `qkv_proj` rows are its q heads,
    then its k and v heads (a kv head is replicated over `tp_size / num_kv_heads` ranks when
    there are fewer kv heads than ranks); `gate_up_proj` rows are its gate then up slice;
    `o_proj`/`down_proj` split the input dim; embedding and LM head split the vocab rows, which
    stay padded (as SGLang's TP=1 `get_weights_by_name` returns them); everything else is
    replicated, and every rank's copy must be identical.
    """
    for hf_part, (sglang_part, position) in _FUSED.items():
        if hf_part in name:
            parts = [read(rank, name.replace(hf_part, sglang_part)) for rank in range(tp_size)]
            if any(part is None for part in parts):
                break
            offsets, kv_replicas = _fused_rows(position, parts[0].shape[0], tp_size, hf_config)
            start, size = offsets
            ranks = range(0, tp_size, kv_replicas)  # one copy of each replicated kv head
            return torch.cat([parts[r].narrow(0, start, size) for r in ranks]).float()
    key = name
    if name in _VOCAB_PARALLEL and read(0, name) is None and hf_config.get("tie_word_embeddings"):
        key = next(other for other in _VOCAB_PARALLEL if other != name)  # tied: stored once
    parts = [read(rank, key) for rank in range(tp_size)]
    if any(part is None for part in parts):
        raise KeyError(f"SGLang has no weight {name!r} on every TP rank (TP size {tp_size})")
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(parts, dim=1).float()
    if name in _VOCAB_PARALLEL:
        return torch.cat(parts, dim=0).float()
    for rank, part in enumerate(parts[1:], start=1):
        if not torch.equal(part, parts[0]):
            raise RuntimeError(
                f"replicated weight {name!r} differs between SGLang TP ranks 0 and {rank}"
            )
    return parts[0].float()


def _fused_rows(
    position: str, num_rows: int, tp_size: int, hf_config: dict[str, Any]
) -> tuple[tuple[int, int], int]:
    """((first row, number of rows) of `position` in one rank's fused parameter, kv replicas)."""
    if position in ("gate", "up"):
        half = num_rows // 2
        return ((0 if position == "gate" else half), half), 1
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    q_rows = num_heads // tp_size * head_dim
    kv_rows = max(1, num_kv_heads // tp_size) * head_dim
    kv_replicas = max(1, tp_size // num_kv_heads)
    if position == "q":
        return (0, q_rows), 1
    return ((q_rows if position == "k" else q_rows + kv_rows), kv_rows), kv_replicas
