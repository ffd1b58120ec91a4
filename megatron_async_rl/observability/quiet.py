"""The warnings of our dependencies that say nothing about the user's run, filtered in one place.

Owned here: `KNOWN_NOISE`, each entry with why it is noise, and `quiet_known_noise()`, which
`train.main` calls before megatron-core or SGLang is imported. It installs `warnings` filters in
this process and the same through `PYTHONWARNINGS` for the processes it starts (SGLang's engine
processes), and lowers the `absl` logger (megatron-core's process-group grid logs every group
at INFO). `MEGATRON_ASYNC_RL_VERBOSE=1` shows them all again.

The CPU-only entries apply only where no GPU is visible: on a GPU machine a missing Transformer
Engine or Apex is worth reading.
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "MEGATRON_ASYNC_RL_VERBOSE"

# (message prefix, category, CPU only, why it is noise)
KNOWN_NOISE: tuple[tuple[str, type[Warning], bool, str], ...] = (
    ("Transformer Engine and Apex are not installed", UserWarning, True,
     "megatron-core on CPU: neither exists there; the torch fallbacks are what CPU runs use"),
    ("Apex is not installed", UserWarning, True, "the same, for megatron-core's norms"),
    ("Only CUDA", UserWarning, True,
     "SGLang's AWQ/GGUF quantization modules, imported whatever the model; unused here"),
    ("Triton is not supported on current platform", UserWarning, True,
     "SGLang's attention utilities on CPU fall back to torch, as intended"),
    ("Only transformer-engine>=", UserWarning, True, "megatron-core's TE spec probe on CPU"),
    ("`load_state_dict` is deprecated", FutureWarning, False,
     "torch.distributed.checkpoint, called inside megatron-core's dist_checkpointing"),
    ("Please use DTensor instead", FutureWarning, False,
     "torch's ShardedTensor deprecation, raised inside megatron-core's dist_checkpointing"),
)  # fmt: skip

# (module, category, why): warnings matched by the module that raises them, where the message
# holds a colon (PYTHONWARNINGS splits on it).
KNOWN_NOISE_BY_MODULE: tuple[tuple[str, type[Warning], str], ...] = (
    ("multiprocessing.resource_tracker", UserWarning,
     "'leaked semaphore objects to clean up at shutdown', at the end of every run: the tracker "
     "unlinks the semaphores SGLang's engine processes held when they were stopped; that "
     "clean-up is its job"),
)  # fmt: skip


def quiet_known_noise(on_cpu: bool | None = None) -> list[str]:
    """Filter `KNOWN_NOISE` (unless `MEGATRON_ASYNC_RL_VERBOSE=1`); returns the prefixes
    filtered. `on_cpu` None: no GPU visible to torch."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return []
    if on_cpu is None:
        import torch

        on_cpu = not torch.cuda.is_available()
    chosen = [(msg, cat) for msg, cat, cpu_only, _ in KNOWN_NOISE if on_cpu or not cpu_only]
    env = [os.environ.get("PYTHONWARNINGS", "")]
    for message, category in chosen:
        warnings.filterwarnings("ignore", message=_regex(message), category=category)
        env.append(f"ignore:{message}:{category.__name__}")
    for module, category, _ in KNOWN_NOISE_BY_MODULE:
        warnings.filterwarnings("ignore", category=category, module=_regex(module))
        env.append(f"ignore::{category.__name__}:{module}")
    os.environ["PYTHONWARNINGS"] = ",".join(item for item in env if item)
    logging.getLogger("absl").setLevel(logging.WARNING)
    return [message for message, _ in chosen]


def _regex(prefix: str) -> str:
    import re

    return re.escape(prefix)
