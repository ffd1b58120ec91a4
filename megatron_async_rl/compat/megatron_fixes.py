"""Fixes for megatron-core 0.16.1 defects that hit every device, CPU and CUDA alike.

Owned here: patches that are not about running on a CPU (those are `megatron_cpu`'s) but about
megatron-core itself, installed by `platform.setup_process` on every platform before a model is
built. Each names the defect and where it was seen; each is idempotent and a no-op where the
defect is absent.

- `moe_utils.te_general_gemm` is imported only inside `try: from transformer_engine ...`, and
  the router's `RouterGatingLinearFunction` tests `te_general_gemm is not None`: without
  Transformer Engine the name is unbound and every MoE forward raises NameError. Seen on an H100
  without Transformer Engine (`tests/gpu/test_parity_cuda.py`, qwen3_moe, 2026-11-25); bound to
  None, the router takes its torch.mm path.
"""

from __future__ import annotations


def install() -> None:
    """Apply every fix (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
