"""What every test rank imports, imported once by the forkserver that forks them (`ranks.py`).

Not a test. Each import is best effort: a module that fails here is imported again by the rank
that needs it, which then reports the real error.
"""

import importlib
import os
import warnings

# megatron-core warns at import about every optional GPU package it lacks.
warnings.filterwarnings("ignore", category=UserWarning)
os.environ.setdefault("OMP_NUM_THREADS", "1")

for _name in (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron_async_rl.distributed.platform",
    "megatron_async_rl.distributed.groups",
    "megatron_async_rl.roles.megatron_role",
    "megatron_async_rl.models.hf_checkpoint",
    "megatron_async_rl.weight_sync.broadcast",
    "megatron_async_rl.engines.sglang.engine",
    "tests.harness.roles",
):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S110 - the rank imports it again and reports it
        pass
