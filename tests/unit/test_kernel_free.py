"""SGLang on CUDA without sgl-kernel (`engines.sglang.kernel_free` and its `sgl_kernel` stand-in):
which implementation each op takes given what is importable, checked on CPU.

Contracts: with the real sgl-kernel every op is its; without it, an op with SGLang's own triton
implementation takes it where triton imports, else the torch one here, and a name without
either raises `NotImplementedError` naming the op (and the server argument that keeps it off,
where one does); each torch fallback computes what SGLang's own `forward_native` computes; the
stand-in resolves every name and submodule SGLang imports; the engine host puts it on the path
only on CUDA without the wheel, and still chooses the kernel-free server arguments then; every
`sgl_kernel` call on the CUDA paths the engine runs (read from the installed SGLang's source) is
in a fused op's forward (native under `ENGINE_ENV`) or covered here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.engines.sglang import kernel_free
from megatron_async_rl.engines.sglang.host import (
    CPU_SHIMS_DIR,
    engine_kwargs,
    use_kernel_free_shims,
)
from megatron_async_rl.engines.sglang.kernel_free import KERNEL_FREE_ARGS
from tests.unit.sgl_kernel_sites import sites

REPO = Path(__file__).resolve().parents[2]
HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.mark.parametrize(
    "name,has_triton,expected",
    [
        ("rmsnorm", True, "torch"),  # forward_cuda callers are forced native; direct ones: torch
        ("silu_and_mul", False, "torch"),
        ("moe_sum_reduce", True, "sglang"),  # SGLang's moe_sum_reduce_triton
        ("moe_sum_reduce", False, "torch"),
        ("utils.is_arch_support_pdl", True, "torch"),
        ("top_k_renorm_prob", True, "none"),  # flashinfer sampling only: raises if called
        ("kvcacheio.transfer_kv_all_layer_mla", True, "none"),
    ],
)
def test_selection_without_sgl_kernel(name, has_triton, expected):
    assert kernel_free.select(name, has_sgl_kernel=False, has_triton=has_triton) == expected


def test_the_real_wheel_wins_for_every_op():
    for name in [*kernel_free.OPS, *kernel_free.GATED, "anything"]:
        assert kernel_free.select(name, has_sgl_kernel=True, has_triton=False) == "sgl_kernel"


def test_resolve_gives_the_selected_callable(monkeypatch):
    monkeypatch.setattr(kernel_free, "importable", lambda module: False)
    assert kernel_free.resolve("moe_sum_reduce") is kernel_free.moe_sum_reduce
    assert kernel_free.resolve("utils.is_arch_support_pdl")() is False
    gated = r"sgl_kernel\.top_k_renorm_prob .*sampling_backend=pytorch"
    with pytest.raises(NotImplementedError, match=gated):
        kernel_free.resolve("top_k_renorm_prob")(torch.ones(2, 3), 1)
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.merge_state .*no fallback"):
        kernel_free.resolve("merge_state")()


def test_torch_fallbacks_keep_sgl_kernels_in_place_contracts():
    x, residual, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    expected_residual = x + residual
    expected = kernel_free.rmsnorm(expected_residual, w, 1e-6)
    kernel_free.fused_add_rmsnorm(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(x, expected)
    out = torch.empty(3, 4)
    assert kernel_free.silu_and_mul(torch.randn(3, 8), out) is out
    partial, summed = torch.randn(5, 2, 8), torch.empty(5, 8)
    kernel_free.moe_sum_reduce(partial, summed, 2.5)
    torch.testing.assert_close(summed, partial.sum(dim=1) * 2.5)


_TWINS = r"""
import json, torch
from sglang.srt.layers.activation import GeluAndMul, SiluAndMul
from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
from megatron_async_rl.engines.sglang import kernel_free as kf

torch.manual_seed(0)
diffs = {}
for dtype in (torch.float32, torch.bfloat16):
    x, r = torch.randn(4, 64, dtype=dtype), torch.randn(4, 64, dtype=dtype)
    for name, cls, plain, fused in (("rmsnorm", RMSNorm, kf.rmsnorm, kf.fused_add_rmsnorm),
            ("gemma_rmsnorm", GemmaRMSNorm, kf.gemma_rmsnorm, kf.gemma_fused_add_rmsnorm)):
        norm = cls(64, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.normal_()
        want = norm.forward_native(x.clone())
        want_x, want_r = norm.forward_native(x.clone(), r.clone())
        got_x, got_r = x.clone(), r.clone()
        fused(got_x, got_r, norm.weight.data, 1e-6)
        diffs[f"{name} {dtype}"] = max(
            (plain(x, norm.weight.data, 1e-6) - want).abs().max().item(),
            (got_x - want_x).abs().max().item(), (got_r - want_r).abs().max().item())
    y = torch.randn(4, 64, dtype=dtype)
    for name, op, fn in (("silu_and_mul", SiluAndMul(), kf.silu_and_mul),
                         ("gelu_and_mul", GeluAndMul("none"), kf.gelu_and_mul),
                         ("gelu_tanh_and_mul", GeluAndMul("tanh"), kf.gelu_tanh_and_mul)):
        diffs[f"{name} {dtype}"] = (fn(y) - op.forward_native(y)).abs().max().item()
print(json.dumps(diffs))
"""


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_torch_fallbacks_equal_sglangs_own_native_forwards():
    # SGLang's layers import on CPU with the CPU engine's shims (torchvision stand-in), as in
    # the engine's own processes; a subprocess keeps them off this one's path.
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(CPU_SHIMS_DIR), str(REPO)]))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _TWINS], env=env, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(diffs) == 10
    assert all(diff == 0.0 for diff in diffs.values()), diffs


_STAND_IN = r"""
import json, sgl_kernel
from sgl_kernel import silu_and_mul, top_k_renorm_prob
from sgl_kernel.utils import is_arch_support_pdl
from sgl_kernel.kvcacheio import transfer_kv_all_layer_mla
from megatron_async_rl.engines.sglang import kernel_free as kf
errors = []
for fn in (top_k_renorm_prob, transfer_kv_all_layer_mla):
    try:
        fn()
    except NotImplementedError as e:
        errors.append(str(e))
print(json.dumps({"shim": sgl_kernel.KERNEL_FREE, "silu": silu_and_mul is kf.silu_and_mul,
                  "pdl": is_arch_support_pdl(), "errors": errors,
                  "has_sgl_kernel": kf.has_sgl_kernel()}))
"""


def test_the_stand_in_resolves_every_name_and_submodule():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(kernel_free.SHIMS_DIR), str(REPO)]))
    done = subprocess.run([sys.executable, "-c", _STAND_IN], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shim"] and result["silu"] and result["pdl"] is False
    assert not result["has_sgl_kernel"]  # the stand-in on the path is not the wheel
    assert "sgl_kernel.top_k_renorm_prob" in result["errors"][0]
    assert "sgl_kernel.kvcacheio.transfer_kv_all_layer_mla" in result["errors"][1]


def test_host_puts_the_stand_in_first_and_keeps_the_kernel_free_args(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    environ = {"PYTHONPATH": "/elsewhere"}
    use_kernel_free_shims(environ)
    assert environ["PYTHONPATH"] == f"{kernel_free.SHIMS_DIR}{os.pathsep}/elsewhere"
    assert {k: environ[k] for k in kernel_free.ENGINE_ENV} == kernel_free.ENGINE_ENV
    assert sys.path[0] == str(kernel_free.SHIMS_DIR)
    importlib.invalidate_caches()
    if importlib.util.find_spec("sgl_kernel").origin.startswith(str(kernel_free.SHIMS_DIR)):
        config = SGLangEngineConfig(model_path="/models/tiny", device="cuda")
        kwargs = engine_kwargs(config)  # looks for sgl-kernel itself, and finds the stand-in
        assert {k: kwargs[k] for k in KERNEL_FREE_ARGS} == KERNEL_FREE_ARGS


# The modules of the CUDA paths the kernel-free engine runs: dense (Llama, Qwen2/3) and MoE
# (Qwen3-MoE) models, triton attention, pytorch sampling, the KV cache.
ENGINE_PATH = (
    "sglang/srt/layers/activation.py",
    "sglang/srt/layers/layernorm.py",
    "sglang/srt/layers/rotary_embedding/base.py",
    "sglang/srt/layers/sampler.py",
    "sglang/srt/layers/logits_processor.py",
    "sglang/srt/layers/linear.py",
    "sglang/srt/layers/vocab_parallel_embedding.py",
    "sglang/srt/layers/moe/topk.py",
    "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py",
    "sglang/srt/layers/quantization/unquant.py",
    "sglang/srt/layers/attention/triton_backend.py",
    "sglang/srt/model_executor/runner_backend_utils/weak_ref_tensor.py",
    "sglang/srt/mem_cache/memory_pool.py",
    "sglang/srt/mem_cache/allocation.py",
    "sglang/kernels/ops/activation/__init__.py",
    "sglang/kernels/ops/sampling/renorm.py",
    "sglang/srt/models/llama.py",
    "sglang/srt/models/qwen2.py",
    "sglang/srt/models/qwen3.py",
    "sglang/srt/models/qwen3_moe.py",
)


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_every_sgl_kernel_call_on_the_engines_cuda_path_is_covered():
    root = Path(importlib.util.find_spec("sglang").origin).parent.parent
    found = [s for rel in ENGINE_PATH for s in sites(root / rel, rel)]
    assert len(found) >= 15, found  # the reader still finds them: 21 on SGLang 0.5.23

    def uncovered(covered):
        return [s for s in found if not s.fused_op_forward and s.name not in covered]

    covered = {*kernel_free.OPS, *kernel_free.GATED}
    assert {s.name for s in uncovered(covered - {"moe_sum_reduce"})} == {"moe_sum_reduce"}
    assert not uncovered(covered), (
        "sgl_kernel calls on the CUDA path with no fallback in engines/sglang/kernel_free.py "
        "(add one to OPS, or to GATED with the server argument that keeps it off): "
        f"{uncovered(covered)}"
    )
    assert {s.name for s in found} & set(kernel_free.OPS) >= {"rmsnorm", "moe_sum_reduce"}
