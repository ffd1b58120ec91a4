"""Per-token log-probs from `transformers` itself, computed in a clean child process.

Owned here: the independent reference the role check (and tests) compare Megatron against.
It runs in a freshly spawned interpreter because `transformers` 5 must not load models in a
process where the megatron-core CPU compatibility layer is installed: with torch's tensor
factories wrapped, its non-persistent RoPE buffers are materialised from uninitialised memory
(logits right at position 0, wrong after). See `compat/megatron_cpu.py`.
"""

from __future__ import annotations

import multiprocessing

import torch


def _logprobs_in_child(path: str, tokens_BT: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(tokens_BT).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens_BT[:, 1:].unsqueeze(-1)).squeeze(-1)


def hf_logprobs(path: str, tokens_BT: torch.Tensor, timeout_s: float = 300.0) -> torch.Tensor:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) under the HF model at `path`, fp32."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply_async(_logprobs_in_child, (path, tokens_BT)).get(timeout=timeout_s)
