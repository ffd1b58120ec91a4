"""megatron-core's defects on every device, and their fixes (`compat/megatron_fixes.py`).

Contract: without Transformer Engine, megatron-core's MoE router gating raises NameError
(`te_general_gemm` unbound: seen on an H100, the CUDA parity test of qwen3_moe); after
the fix (declared for megatron-core 0.16.x, which has the defect; 0.19 binds the name to None
itself) it computes `input @ weight.T` with torch, and `install` leaves a bound name alone. Runs
on CPU without the CPU compatibility layer's patches for this defect.
"""

import pytest
import torch


def test_router_gating_without_transformer_engine(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from megatron_async_rl.compat import megatron_fixes

    if getattr(moe_utils, "HAVE_TE", False):
        pytest.skip("Transformer Engine is installed: the defect does not arise")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    inp, weight = torch.randn(5, 8), torch.randn(4, 8)
    with pytest.raises(NameError, match="te_general_gemm"):  # the upstream defect, still there
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    megatron_fixes._BY_NAME["te_general_gemm_unbound"].apply()
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.T)


def test_install_leaves_a_bound_name_alone(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from megatron_async_rl.compat import megatron_fixes

    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    megatron_fixes.install()
    assert moe_utils.te_general_gemm is sentinel
