"""The recipe's `engine:` section: how each `generate` rank's SGLang engine is started.

Owned here: `EngineConfig` (validated recipe knobs) and its translation into the engine
implementation's own config. Called by the jobs that start engines on generate ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_async_rl.config.checks import require_choice, require_int, require_number

CPU_DEFAULT_KV_TOKENS = 65536
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    """One SGLang engine per generate rank."""

    tp_size: int = 1
    """Tensor parallel size inside one engine. On CPU each TP rank gets its own cores: those of
    SGLANG_CPU_OMP_THREADS_BIND when set (one '|'-separated group per rank, e.g. "0|1"),
    otherwise the engine host splits the available cores evenly."""
    dtype: str = "auto"
    """Engine weights dtype: auto (the checkpoint's), float32, bfloat16 or float16. Use float32
    on CPU for engine log-probs that match the trainer's within 1e-3."""
    max_total_tokens: int | None = None
    """KV-cache capacity in tokens. None: SGLang sizes it on GPU; on CPU 65536 (SGLang would
    reserve most of the RAM: 13 GB and 51 s of start-up measured for a tiny fp32 model)."""
    mem_fraction_static: float | None = None
    """Fraction of device memory SGLang may take for weights and KV cache; None: its default."""
    startup_timeout_s: float = 600.0
    """Seconds an engine may take to start before the run stops with an error."""
    call_timeout_s: float = 300.0
    """Seconds any engine call other than generate may take."""
    generate_timeout_s: float = 3600.0
    """Seconds one generate call may take."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra `sglang.Engine` keyword arguments, passed through as given."""

    def __post_init__(self) -> None:
        require_int("tp_size", self.tp_size, 1)
        require_choice("dtype", self.dtype, DTYPES)
        require_int("max_total_tokens", self.max_total_tokens, 1, optional=True)
        require_number("mem_fraction_static", self.mem_fraction_static, gt=0, le=1, optional=True)
        for name in ("startup_timeout_s", "call_timeout_s", "generate_timeout_s"):
            require_number(name, getattr(self, name), gt=0, unit="seconds")

    def sglang_config(self, model_path: str, device: str, seed: int):
        """The `SGLangEngineConfig` for one engine serving `model_path`."""
        from megatron_async_rl.engines.sglang_engine import SGLangEngineConfig

        return SGLangEngineConfig(
            model_path=model_path,
            device=device,
            tp_size=self.tp_size,
            dtype=self.dtype,
            max_total_tokens=self.max_total_tokens
            or (CPU_DEFAULT_KV_TOKENS if device == "cpu" else None),
            mem_fraction_static=self.mem_fraction_static,
            random_seed=seed,
            server_args=dict(self.server_args),
            startup_timeout_s=self.startup_timeout_s,
            call_timeout_s=self.call_timeout_s,
            generate_timeout_s=self.generate_timeout_s,
        )
