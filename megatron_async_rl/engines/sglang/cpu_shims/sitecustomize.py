"""CPU engine processes only (this directory is on their PYTHONPATH): three SGLang patches.

All apply to SGLang 0.5.21 to 0.5.23 (`PATCHED_VERSIONS`: measured on 0.5.21 and 0.5.23; 0.5.22
has the same code); with any other version nothing is patched. Each is installed as an import
hook that runs once its module has been imported, so processes that never import it (and the
GPU path, where this directory is never on the path) are untouched. See README.md.

- `sglang.srt.mem_cache.pool_host.common`: the routed experts SGLang returns
  (`enable_return_routed_experts`, for MoE routing replay) live in a host buffer that it pins
  with `cudaHostRegister` (`_cuda_host_register`), which fails without CUDA ("Torch not compiled
  with CUDA enabled"). With no GPU there is nothing to pin the buffer for: it does nothing.
- `sglang.srt.models.deepseek_common.attention_backend_handler`: multi-latent attention models
  (DeepSeek-V2/V3) ask this registry which attention form to run. It has no entry for
  `torch_native`, the CPU engine's backend, and falls back to the Triton one, which answers
  "MHA" for a prefill without cached prefix: that form hands the backend expanded per-head keys
  to attend over directly, which the torch-native backend does not do (it reads its KV cache,
  which holds the latent; "Expected size for first two dimensions of batch2 tensor to be:
  [4, 24] but got: [4, 40]"). For `torch_native` the registry here answers SGLang's own
  absorbed-MLA form for every batch, which reads the latent cache as the backend does.
- `sglang.srt.layers.attention.attention_registry`: `torch_native` builds
  `megatron_async_rl.engines.sglang.batched_attention.BatchedTorchNativeAttnBackend` (one SDPA
  call per layer for each group of equal-length requests, not one per request), unless
  `MEGATRON_ASYNC_RL_CPU_ATTENTION` is `per_request` (`engine.cpu_attention`).
"""

import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys

PATCHED_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")


def _no_pinning(buffer, registration_granularity_bytes=None):
    """No CUDA: the host buffer stays ordinary memory."""


def _patch_host_register(module):
    module._cuda_host_register = _no_pinning


def _patch_mla_handler(module):
    def handle_attention_torch_native(attn, forward_batch):
        return module._dispatch_mla_subtype(attn, forward_batch)

    module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


def _patch_attention_registry(module):
    if os.environ.get("MEGATRON_ASYNC_RL_CPU_ATTENTION", "batched") == "per_request":
        return

    @module.register_attention_backend("torch_native")
    def create_batched_torch_native_backend(runner):
        from megatron_async_rl.engines.sglang.batched_attention import (
            BatchedTorchNativeAttnBackend,
        )

        return BatchedTorchNativeAttnBackend(runner)


_PATCHES = {
    "sglang.srt.layers.attention.attention_registry": _patch_attention_registry,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_register,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_handler,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches):
        self.patches = dict(patches)

    def find_spec(self, name, path, target=None):
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        if not self.patches:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the real module (this finder no longer claims it)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _sglang_version():
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


if _sglang_version() in PATCHED_VERSIONS:
    sys.meta_path.insert(0, _PatchAfterImport(_PATCHES))
