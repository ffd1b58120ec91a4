"""Run megatron-core 0.16.x on a CPU-only torch (gloo): the compatibility layer.

Owned here: every patch that lets real `megatron.core` GPT models build, run forward/backward,
and step their optimizer on CPU. Called once per process by `platform.setup_platform()` before any
Megatron model is built, and only when no CUDA device is used; on a GPU nothing here is touched.

Why it exists (measured in shared/facts/megatron_cpu.md): megatron-core reaches CUDA from ~80
call sites. They fall in four kinds, each handled by one named patch below:

1. `torch.cuda` queries (current_device, synchronize, streams, events, nvtx): answered with CPU
   stand-ins (`_patch_torch_cuda`).
2. Literal `device="cuda"`, `.cuda()` and `pin_memory=True` inside large per-step functions
   (optimizer constructors, clip_grads, pipeline schedules): tensor factories and `Tensor.cuda`/
   `Tensor.to` are wrapped to map "cuda" to "cpu" (`_patch_tensor_factories`); the device mesh
   of megatron-core's FSDP2 wrapper, `DeviceMesh.from_group(group, "cuda")`, gets "cpu" too
   (`_patch_fsdp_mesh`). Wrapping the functions (instead of a TorchFunctionMode) keeps working
   inside custom autograd backward and activation recompute, where modes are disabled.
   `Tensor.type()` reports the CUDA type name for CPU tensors because the fp16/bf16 optimizers
   accept only 'torch.cuda.*Tensor' names.
3. The CUDA RNG tracker: each named state is a CPU generator state seeded by its own seed
   (`_patch_rng`); `torch.cuda.manual_seed` is a silent no-op on CPU torch, so callers must also
   call `torch.manual_seed` before building models (done by `models.builder`).
4. MoE utilities gated on `is_cuda` (`_patch_moe`). (Defects that hit CUDA too, such as the
   unbound `te_general_gemm` without Transformer Engine, are `compat/megatron_fixes.py`'s.)

Trade-off: these patches are process-global. They are therefore opt-in (`install()`), refused on
a process that has used CUDA (a GPU that is only visible is hidden instead), refused for
megatron-core versions they were not measured on, and idempotent. `installed()` says whether
they are active.

Known casualty: `transformers` 5 must not load a model in a process where this layer is
installed. With the factories wrapped, its non-persistent RoPE `inv_freq` buffers come out of
uninitialised memory (logits right at position 0, wrong or NaN after; measured). Reference
forward passes therefore run in a clean child process (`models/hf_reference.py`), and SGLang
engines never share a process with this layer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from megatron_async_rl.compat import versions

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_VERSIONS = ">=0.16.1,<0.20"  # measured on 0.16.1 and 0.19.2
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided",
)  # fmt: skip
_STATE = {"installed": False}


def installed() -> bool:
    """Whether the CPU compatibility layer is active in this process."""
    return _STATE["installed"]


def install() -> None:
    """Install every patch (idempotent). Raises RuntimeError in a process that has used CUDA
    or on an unknown megatron-core version. A GPU that is merely visible is hidden from this
    process (`torch.cuda.is_available()` is False after), so a GPU node runs CPU recipes and
    the CPU suite as a CPU-only machine does."""
    if _STATE["installed"]:
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "megatron_cpu.install(): this process already uses CUDA; the CPU compatibility "
            "layer is only for processes that run on the CPU (platform.device=cpu)"
        )
    from packaging.specifiers import SpecifierSet

    version = versions.installed_version("megatron-core")
    if not SpecifierSet(SUPPORTED_MEGATRON_VERSIONS).contains(version, prereleases=True):
        raise RuntimeError(
            f"megatron-core {version} is not supported on CPU: the compatibility layer was "
            f"measured on megatron-core{SUPPORTED_MEGATRON_VERSIONS}; install a release in "
            "that range (constraints/cpu.txt has the one tested here)"
        )
    versions.install(PATCHES)
    _STATE["installed"] = True
    # Once per run, not once per rank (each rank installs it before its log lines are labelled).
    log = logger.info if os.environ.get("RANK", "0") == "0" else logger.debug
    log("megatron-core %s CPU compatibility layer installed", version)


# ----------------------------------------------------------------------------------------------
# 1. torch.cuda queries


class _CpuStream:
    """Stand-in for torch.cuda.Stream: work on CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Stand-in for torch.cuda.Event; timing events measure wall time on CPU."""

    def __init__(self, enable_timing: bool = False, *args, **kwargs):
        self._time = None

    def record(self, stream=None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._time - self._time) * 1000.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: False  # megatron-core gates GPU paths on it
    cuda.device_count = lambda: 0
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _CpuStream()
    cuda.default_stream = lambda device=None: _CpuStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.nvtx.range_push = lambda msg: 0
    cuda.nvtx.range_pop = lambda: 0
    cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.Tensor.record_stream = lambda self, stream: None


# ----------------------------------------------------------------------------------------------
# 2. literal "cuda" devices


def _cpu_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    wrapper.__megatron_cpu_wrapped__ = True
    return wrapper


def _patch_tensor_factories() -> None:
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "__megatron_cpu_wrapped__", False):
            setattr(torch, name, _wrap_factory(fn))

    original_to = torch.Tensor.to
    original_type = torch.Tensor.type

    def to(self, *args, **kwargs):
        if args:
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original_type(self)
            # bf16/fp16 optimizers accept only CUDA type names; the CPU tensor plays that role.
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = cuda
    torch.Tensor.type = tensor_type


def _patch_fsdp_mesh() -> None:
    """`TorchFullyShardedDataParallel.__init__` (torch_fully_sharded_data_parallel.py:81) builds
    `DeviceMesh.from_group(group, "cuda")`; torch's `fully_shard` then asks that device type's
    current device for an index (TypeError) and would place every shard there. A CPU mesh over
    the same group is what FSDP2 runs on with gloo."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp

    mesh = getattr(fsdp, "DeviceMesh", None)  # absent: a torch without FSDP2
    if mesh is None or getattr(mesh, "__megatron_cpu_wrapped__", False):
        return

    class CpuDeviceMesh:
        __megatron_cpu_wrapped__ = True

        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return mesh.from_group(group, _cpu_device(device_type), *args, **kwargs)

    fsdp.DeviceMesh = CpuDeviceMesh


# ----------------------------------------------------------------------------------------------
# 3. the RNG tracker


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"RNG tracker: seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name=mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        # On CPU the "CUDA" state is the CPU generator: swap it in and out around the block.
        if name not in self.states_:
            raise RuntimeError(f"RNG tracker: state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    mc_random._get_cuda_rng_state = get_state
    mc_random._set_cuda_rng_state = set_state
    mc_random.CudaRNGStatesTracker.add = add
    mc_random.CudaRNGStatesTracker.fork = fork


# ----------------------------------------------------------------------------------------------
# 4. MoE utilities


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # Upstream gates on `is_cuda`, leaving CPU split sizes as tensors where lists are needed.
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ----------------------------------------------------------------------------------------------
# Where megatron-core reaches CUDA (each patch's probe: the call site, in upstream's source)


def _source_has(module_name: str, attribute: str | None, *needles: str) -> bool:
    import importlib
    import inspect

    target = importlib.import_module(module_name)
    if attribute is not None:
        for part in attribute.split("."):
            target = getattr(target, part)
    source = inspect.getsource(target)
    return all(needle in source for needle in needles)


_ALL = SUPPORTED_MEGATRON_VERSIONS
PATCHES = [
    versions.Patch(
        "cpu_torch_cuda_queries", "megatron-core", _ALL,
        "megatron-core asks torch.cuda for the current device, streams and events",
        _patch_torch_cuda,
        lambda: _source_has("megatron.core.utils", None, "torch.cuda.current_device()"),
    ),
    versions.Patch(
        "cpu_literal_cuda_devices", "megatron-core", _ALL,
        "optimizers and grad clipping make tensors with device='cuda' / .cuda()",
        _patch_tensor_factories,
        lambda: _source_has("megatron.core.optimizer.clip_grads", None, "device='cuda'"),
    ),
    versions.Patch(
        "cpu_fsdp2_cuda_mesh", "megatron-core", _ALL,
        "the torch FSDP2 wrapper meshes its group on device type 'cuda'",
        _patch_fsdp_mesh,
        lambda: _source_has(
            "megatron.core.distributed.torch_fully_sharded_data_parallel",
            "TorchFullyShardedDataParallel.__init__", "from_group(", "\"cuda\"",
        ),
    ),
    versions.Patch(
        "cpu_cuda_rng_tracker", "megatron-core", _ALL,
        "the model-parallel RNG tracker keeps CUDA generator states",
        _patch_rng,
        lambda: _source_has("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
                            "torch.cuda"),
    ),
    versions.Patch(
        "cpu_moe_split_sizes", "megatron-core", _ALL,
        "maybe_move_tensor_to_cpu leaves CPU split sizes as tensors (gated on is_cuda)",
        _patch_moe,
        lambda: _source_has("megatron.core.transformer.moe.moe_utils",
                            "maybe_move_tensor_to_cpu", "is_cuda"),
    ),
]  # fmt: skip
