"""Platform detection and process-group start: CPU + gloo or CUDA + NCCL, chosen, never edited.

Owned here: deciding the device and collective backend from the recipe (`platform.device`,
`platform.backend`, each `auto` by default) and what this machine has; starting
`torch.distributed`; installing the megatron-core CPU compatibility layer on CPU. Called by the
entry point and by the distributed tests, before any group or model is built.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where tensors live and how ranks talk."""

    device_type: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    local_rank: int = 0
    """This process's index on its node (torchrun's LOCAL_RANK): its GPU on CUDA."""
    gpu: int | None = None
    """Its CUDA device where that is not `local_rank` (`local_gpu`: ranks sharing GPUs)."""

    @property
    def use_cuda(self) -> bool:
        return self.device_type == "cuda"

    def device(self) -> torch.device:
        """The rank's device, the same from every thread (the current CUDA device is per
        thread; a worker thread would get GPU 0 from `torch.cuda.current_device()`)."""
        if self.use_cuda:
            return torch.device("cuda", self.local_rank if self.gpu is None else self.gpu)
        return torch.device("cpu")


def local_gpu(local_rank: int, device_count: int) -> int:
    """The CUDA device of local rank `local_rank`: its own where the node has one per rank,
    else they are shared in turn (`local_rank % device_count`: two ranks on one GPU, e.g. the
    Megatron roles and an engine on a one-GPU machine)."""
    if local_rank < device_count or device_count < 1:
        return local_rank
    return local_rank % device_count


def detect_platform(device: str = "auto", backend: str = "auto") -> Platform:
    """Resolve `auto` choices; raise ValueError when the recipe asks for what is not here."""
    has_cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        raise ValueError(
            "platform.device = cuda: no CUDA device is visible to this process "
            "(torch.cuda.is_available() is False); use platform.device=cpu or auto"
        )
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"platform.backend = nccl: NCCL needs platform.device=cuda, got {device}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = None
    if device == "cuda" and local_rank >= (count := torch.cuda.device_count()):
        if backend == "nccl":
            raise ValueError(
                f"platform.backend = nccl: local rank {local_rank} has no GPU of its own "
                f"({count} visible) and NCCL refuses two ranks on one GPU; use "
                "platform.backend=gloo to share GPUs, or start at most one rank per GPU"
            )
        gpu = local_gpu(local_rank, count)
        logger.warning("local rank %d shares GPU %d (%d visible)", local_rank, gpu, count)
    return Platform(device, backend, local_rank, gpu)


def init_distributed(
    platform: Platform,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float = 600.0,
) -> tuple[int, int]:
    """Start the default process group (env:// under torchrun) and prepare this process.

    Returns (rank, world_size). On CPU, installs the Megatron compatibility layer and pins torch
    to a thread count that does not oversubscribe the cores shared by the local ranks.
    """
    if platform.use_cuda:
        torch.cuda.set_device(platform.device())
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    elif (store := elastic_store(kwargs["timeout"])) is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
    dist.init_process_group(backend=platform.backend, **kwargs)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_process(platform)
    return rank, world_size


def elastic_store(timeout: datetime.timedelta):
    """torchrun's own store, under a prefix of this restart attempt (None outside torchrun).

    Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) the ranks use the store its agent
    hosts, and with its static rendezvous (`--master-addr/--master-port`) the agent keeps that
    store across `--max-restarts` restarts while torch adds no prefix per attempt: a restarted
    rank then read the dead world's keys (gloo's addresses of the old ranks) and failed with
    "connection refused". Each attempt's keys go under `attempt_<TORCHELASTIC_RESTART_COUNT>`.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout,
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megatron_async_rl/attempt_{attempt}", client)


def setup_process(platform: Platform) -> None:
    """Per-process Megatron state that is not a process group (idempotent)."""
    from megatron.core import parallel_state

    from megatron_async_rl.compat import megatron_fixes

    megatron_fixes.install()  # megatron-core defects on every device
    if not platform.use_cuda:
        from megatron_async_rl.compat import megatron_cpu

        megatron_cpu.install()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # Local DotProductAttention reads this rank-local buffer (facts: leak 1); not a group.
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


LOGPROB_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-1}
"""Max abs difference of per-token log-probs two correct sources may show, by the precision the
models run in: fp32 with TF32 off (`exact_fp32_matmuls`); bf16 (8-bit mantissa, different
reduction orders per layout). On an H100 (2026-11-25) the logits of the tiny bf16 models were
within 4.2e-2 to 9.2e-2 of fp32 (`tests/gpu/test_parity_cuda.py`); log-probs across layouts in
bf16 are not measured there yet (one GPU)."""


def exact_fp32_matmuls() -> None:
    """TF32 off for fp32 matmuls and convolutions, in torch and in Transformer Engine (its fp32
    GEMMs use cuBLASLt's FAST_TF32 unless NVIDIA_TF32_OVERRIDE=0, read when cuBLAS starts: call
    this before the first GEMM). For parity checks; training keeps TF32 where it is on."""
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
