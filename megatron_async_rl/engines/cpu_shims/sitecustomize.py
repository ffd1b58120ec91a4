"""CPU engine processes only (this directory is on their PYTHONPATH): one SGLang patch.

SGLang 0.5.21 keeps the routed experts it returns (`enable_return_routed_experts`, for MoE
routing replay) in a host buffer that it pins with `cudaHostRegister`
(`sglang.srt.mem_cache.pool_host.common._cuda_host_register`), which fails without CUDA
("Torch not compiled with CUDA enabled"). With no GPU there is nothing to pin the buffer for:
once that module is imported, its `_cuda_host_register` does nothing. Installed as an import
hook, so processes that never import it (and the GPU path, where this directory is never on
the path) are untouched. See README.md.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _no_pinning(buffer, registration_granularity_bytes=None):
    """No CUDA: the host buffer stays ordinary memory."""


class _PatchHostRegister(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module, then patch it once it has run
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._cuda_host_register = _no_pinning

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchHostRegister())
