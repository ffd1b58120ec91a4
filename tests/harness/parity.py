"""The HF-parity reference shared by `tests/distributed/test_hf_parity.py`, its MoE routing
replay (`tests/harness/routing.py`) and its GPU twin (`tests/gpu/test_parity_cuda.py`): the
model families, the logits tolerance, and the token batch they are compared on."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
TOLERANCE = 1e-4


def parity_tokens(vocab_size: int) -> torch.Tensor:
    """4 x 24 token ids, the same in every process (seed 11)."""
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, vocab_size, (4, 24), generator=generator)
