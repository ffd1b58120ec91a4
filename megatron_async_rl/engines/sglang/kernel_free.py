"""SGLang on CUDA without its kernel wheel (sgl-kernel): which implementation each op runs.

A GPU machine that carries SGLang without sgl-kernel and flashinfer (`scripts/gpu_bundle.sh`)
runs the engine on SGLang's own torch and triton code. Three parts make that work:

- `ENGINE_ENV`, set by the engine host before it imports SGLang, uses two of SGLang's own
  switches. The first skips the start-up assertion of sglang-kernel's version. The second,
  `SGLANG_FORCE_FUSED_OP_BACKEND=torch`, makes every `BaseFusedOp` run its `forward_native`:
  the norms, activations and rotary embedding, whose `forward_cuda` calls sgl-kernel.
- `KERNEL_FREE_ARGS`: triton attention, pytorch sampling, no CUDA graphs, no custom
  all-reduce.
- `kernel_free_shims/sgl_kernel`, first on the engine processes' path, stands in for the
  wheel. SGLang imports many of its names at module level under `if is_cuda()`, so each name
  must resolve. A name resolves to what `select` picks for it:
  - the real `sgl_kernel`, where it imports (then the shim is never on the path);
  - else SGLang's own implementation of the op (triton, where triton imports);
  - else the torch one here;
  - else a stand-in that raises `NotImplementedError`, naming the op, when called.

`OPS` lists the names SGLang 0.5.23 calls outside a `BaseFusedOp` forward on the dense and MoE
paths, with their fallbacks. `GATED` lists the names that the paths above import but never call
under `KERNEL_FREE_ARGS`, with the argument that keeps each off.
`tests/unit/test_kernel_free.py` checks the selection, checks each torch fallback against
SGLang's own `forward_native` on CPU, and checks against the installed SGLang's source that
every name those paths import is in `OPS` or `GATED`, or is called only in a fused op's
`forward_*`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

SHIMS_DIR = Path(__file__).resolve().parent / "kernel_free_shims"

KERNEL_FREE_ARGS = {
    "attention_backend": "triton",  # SGLang's triton kernels: triton ships with CUDA torch
    "sampling_backend": "pytorch",  # not flashinfer's sampling kernels
    "disable_cuda_graph": True,  # its capture uses sgl-kernel's ops
    "disable_custom_all_reduce": True,  # sgl-kernel's all-reduce; NCCL's instead
}
"""SGLang's server arguments for its torch and triton paths (no sgl-kernel, no flashinfer)."""

ENGINE_ENV = {
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # Engine start asserts sglang-kernel >= 0.4.9
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",  # every BaseFusedOp runs its forward_native
}


# --- torch fallbacks, with sgl-kernel's signatures and in-place contracts -----------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """`out = input / rms(input) * weight` (float32 inside, as SGLang's RMSNorm)."""
    del enable_pdl
    result = _rms(input, weight, eps).to(input.dtype)
    return result if out is None else out.copy_(result)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place: `residual += input`, then `input = rmsnorm(residual)`, normalising the float32
    sum (not the sum rounded to the residual's dtype), as sgl-kernel and SGLang's RMSNorm."""
    del enable_pdl
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_rms(total, weight, eps).to(input.dtype))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """Gemma's form: the weight is stored minus one (`* (1 + weight)`)."""
    return rmsnorm(input, weight.float() + 1.0, eps, out, enable_pdl)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place, as SGLang's GemmaRMSNorm: the sum rounded to the residual's dtype, then
    normalised."""
    residual.add_(input)
    gemma_rmsnorm(residual, weight, eps, out=input, enable_pdl=enable_pdl)


def _act_and_mul(act: Callable[[torch.Tensor], torch.Tensor]):
    def op(input, out=None):
        d = input.shape[-1] // 2
        result = act(input[..., :d]) * input[..., d:]
        return result if out is None else out.copy_(result)

    return op


silu_and_mul = _act_and_mul(F.silu)
gelu_and_mul = _act_and_mul(lambda x: F.gelu(x, approximate="none"))
gelu_tanh_and_mul = _act_and_mul(lambda x: F.gelu(x, approximate="tanh"))


def moe_sum_reduce(input, output, routed_scaling_factor):
    """`output = input.sum(dim=1) * routed_scaling_factor` (tokens x top-k x hidden)."""
    torch.sum(input, dim=1, out=output)
    output.mul_(routed_scaling_factor)


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch off: a triton launch without it is plain and correct."""
    return False


@dataclass(frozen=True)
class Op:
    """One sgl-kernel name: SGLang's own triton implementation (`module:attr`), if it has one,
    then the torch fallback here."""

    sglang: str | None = None
    torch: Callable | None = None


OPS: dict[str, Op] = {
    # direct callers: srt/layers/activation.py (module functions), MoE's fused sequence
    "silu_and_mul": Op(torch=silu_and_mul),
    "gelu_and_mul": Op(torch=gelu_and_mul),
    "gelu_tanh_and_mul": Op(torch=gelu_tanh_and_mul),
    # direct callers of the norms, beside RMSNorm's forward_cuda (forced native)
    "rmsnorm": Op(torch=rmsnorm),
    "fused_add_rmsnorm": Op(torch=fused_add_rmsnorm),
    "gemma_rmsnorm": Op(torch=gemma_rmsnorm),
    "gemma_fused_add_rmsnorm": Op(torch=gemma_fused_add_rmsnorm),
    # srt/layers/moe/moe_runner/triton_utils/fused_moe.py: moe_combine_topk
    "moe_sum_reduce": Op(
        sglang="sglang.kernels.ops.moe.fused_moe_triton_kernels:moe_sum_reduce_triton",
        torch=moe_sum_reduce,
    ),
    # srt/layers/attention/triton_backend.py (`from sgl_kernel.utils import ...`)
    "utils.is_arch_support_pdl": Op(torch=is_arch_support_pdl),
}

GATED: dict[str, str] = {
    "top_k_renorm_prob": "sampling_backend=pytorch (srt/layers/sampler.py: flashinfer only)",
    "top_p_renorm_prob": "sampling_backend=pytorch (srt/layers/sampler.py: flashinfer only)",
    "weak_ref_tensor": "disable_cuda_graph (runner_backend_utils: graph capture only)",
}


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def kernel_free_args(device: str, has_sgl_kernel: bool) -> dict:
    """Server arguments for a CUDA engine where sgl-kernel cannot be imported (the GPU test
    machine carries SGLang without its kernel wheels, `scripts/gpu_bundle.sh`): `KERNEL_FREE_ARGS`.
    None on CPU (its own backend) or where sgl-kernel is there."""
    return dict(KERNEL_FREE_ARGS) if device == "cuda" and not has_sgl_kernel else {}


def has_sgl_kernel() -> bool:
    """Whether the real sgl-kernel wheel imports here (the stand-in in `SHIMS_DIR` does not
    count, so the answer holds after the engine host put it on the path)."""
    try:
        spec = importlib.util.find_spec("sgl_kernel")
    except (ImportError, ValueError):
        return False
    return spec is not None and SHIMS_DIR not in Path(spec.origin or "").parents


def select(name: str, *, has_sgl_kernel: bool, has_triton: bool) -> str:
    """Which implementation `sgl_kernel.<name>` runs: "sgl_kernel", "sglang" (SGLang's own
    triton code), "torch" (this module) or "none" (raises when called)."""
    if has_sgl_kernel:
        return "sgl_kernel"
    op = OPS.get(name)
    if op is None:
        return "none"
    if op.sglang is not None and has_triton:
        return "sglang"
    return "torch" if op.torch is not None else "none"


def resolve(name: str) -> Callable:
    """The callable the shim gives for `sgl_kernel.<name>` on this machine (no sgl-kernel)."""
    path = select(name, has_sgl_kernel=False, has_triton=importable("triton"))
    if path == "sglang":
        module, attr = OPS[name].sglang.split(":")
        return getattr(importlib.import_module(module), attr)
    if path == "torch":
        return OPS[name].torch
    return _missing(name)


def _missing(name: str) -> Callable:
    why = GATED.get(name, "no fallback for it")

    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called on a CUDA engine without sgl-kernel ({why}): "
            "install sglang-kernel, or keep the engine to the kernel-free server arguments "
            "(engines/sglang/kernel_free.py KERNEL_FREE_ARGS)"
        )

    kernel.__name__ = name.rsplit(".", 1)[-1]
    return kernel
