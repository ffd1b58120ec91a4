"""Stand-in for `sgl_kernel` in a CUDA engine's processes where the wheel is absent.

Only on the engine processes' path, and only when the real `sgl_kernel` does not import
(`engines/sglang/host.py`). Every name, and every name of every submodule
(`sgl_kernel.utils`, `sgl_kernel.kvcacheio`, ...), resolves through
`megatron_async_rl.engines.sglang.kernel_free.resolve`: SGLang's own triton implementation or a
torch one where there is one, else a function that raises `NotImplementedError` naming the op.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

from megatron_async_rl.engines.sglang import kernel_free

__version__ = "0.0.0+megatron_async_rl.kernel_free"
KERNEL_FREE = True  # tells this stand-in from the wheel


def _resolver(prefix: str, namespace: dict):
    """A module `__getattr__` that resolves a name once and keeps it in `namespace` (the
    module's globals), so later lookups (`sgl_kernel.op(...)` on a hot path) are plain ones."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = namespace[name] = kernel_free.resolve(prefix + name)
        return value

    return __getattr__


__getattr__ = _resolver("", globals())


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import sgl_kernel.<sub>`: a module whose names resolve as `<sub>.<name>`."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _resolver(spec.name[len(__name__) + 1 :] + ".", module.__dict__)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
