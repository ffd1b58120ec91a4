"""The recipe's `engine:` section: how each `generate` rank's SGLang engine is started.

Owned here: `EngineConfig` (validated recipe knobs) and its translation into
`SGLangEngineConfig`, the config of one `engines.sglang.engine.SGLangEngine` (and of its host
process, `engines.sglang.host`); and the `faults:` section (`FaultsConfig`, what
`engines.recovery.faults` injects). Called by the jobs that start engines on generate ranks. Pure:
no torch, no sglang (the recipe loader imports it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megatron_async_rl.config.checks import require_choice, require_int, require_number
from megatron_async_rl.config.errors import ConfigError

CPU_DEFAULT_KV_TOKENS = 65536
DTYPES = ("auto", "float32", "bfloat16", "float16")
PROCESS_STARTS = ("auto", "fork", "spawn")
CPU_ATTENTIONS = ("batched", "per_request")


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
    """Extra `sglang.Engine` keyword arguments, passed through as given; they win over the
    engine's defaults (`engines/sglang/host.engine_kwargs`: e.g. `skip_tokenizer_init: true`,
    no tokenizer or detokenizer in the engine, since the ranks tokenize and decode)."""
    max_restarts: int = 3
    """Restarts in place an engine may take within `restart_window_steps` steps when it dies,
    stops answering or hangs (`engines.recovery.restarting`); one more stops the run with every
    cause.
    To reload its weights, the engine host keeps the newest complete version in host memory
    (one model; two while a version loads). 0: no restart, no copy; a dead engine stops the run."""
    restart_window_steps: int = 100
    """The window of steps `max_restarts` counts in."""
    health_timeout_s: float = 120.0
    """A hung engine is killed and restarted within about this plus `health_check_every_s`:
    two one-token probes in a row, each given half of it, went unanswered."""
    health_check_every_s: float = 30.0
    """Seconds between health probes while the engine is neither paused nor loading weights;
    0 turns the probes off (deaths are still found by the calls that meet them)."""
    progress_every_tokens: int = 8
    """While an engine generates, its host reports each request's tokens every this many
    tokens (at most twice a second), so that a request cut by the engine's death goes on from
    its prefix on the restarted engine. 0: no reports; a cut request is generated again from
    its prompt. Only with `max_restarts` > 0."""

    reassign: bool = True
    """With more than one engine, a dead engine's requests are taken over by the others while
    it restarts (`engines.recovery.reassign`); false: it carries them on itself once restarted."""
    process_start: str = "auto"
    """How the engine host starts SGLang's scheduler and detokenizer processes: `spawn` (SGLang's
    own choice: each process imports SGLang and torch again), `fork` (from the host, which has
    imported them: on CPU an engine starts in about half the time and a third of the CPU
    seconds, measured), or `auto`: fork on CPU, spawn on CUDA (CUDA cannot be forked)."""

    cpu_attention: str = "batched"
    """The CPU engine's attention (`engines/sglang/batched_attention.py`): `batched`, one SDPA
    call per layer for each group of equal-length requests, bit for bit the loop's results
    (2.3x faster generation at hidden 384 x 6 layers, 48 new tokens, measured by
    `benchmarks/engine_generate.py`), or `per_request`, SGLang's own torch-native loop over the
    requests. GPU engines use SGLang's GPU backends either way."""

    def __post_init__(self) -> None:
        require_int("tp_size", self.tp_size, 1)
        if not isinstance(self.reassign, bool):
            raise ConfigError("reassign", self.reassign, "must be true or false")
        require_int("max_restarts", self.max_restarts, 0)
        require_int("restart_window_steps", self.restart_window_steps, 1)
        require_int("progress_every_tokens", self.progress_every_tokens, 0)
        require_number("health_timeout_s", self.health_timeout_s, gt=0, unit="seconds")
        require_number("health_check_every_s", self.health_check_every_s, ge=0, unit="seconds")
        require_choice("dtype", self.dtype, DTYPES)
        require_choice("process_start", self.process_start, PROCESS_STARTS)
        require_choice("cpu_attention", self.cpu_attention, CPU_ATTENTIONS)
        require_int("max_total_tokens", self.max_total_tokens, 1, optional=True)
        require_number("mem_fraction_static", self.mem_fraction_static, gt=0, le=1, optional=True)
        for name in ("startup_timeout_s", "call_timeout_s", "generate_timeout_s"):
            require_number(name, getattr(self, name), gt=0, unit="seconds")

    def sglang_config(self, model_path: str, device: str, seed: int) -> SGLangEngineConfig:
        """The `SGLangEngineConfig` for one engine serving `model_path`."""
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
            progress_every_tokens=self.progress_every_tokens if self.max_restarts else 0,
            process_start=self.process_start,
            cpu_attention=self.cpu_attention,
        )


@dataclass(frozen=True)
class RoutingCapture:
    """What an engine returns of its MoE routing: `num_layers` decoder layers, `topk` experts
    per token of `num_experts`; `layers` the MoE ones (0-based), the rows kept."""

    num_layers: int
    topk: int
    layers: tuple[int, ...]
    num_experts: int


@dataclass(frozen=True)
class SGLangEngineConfig:
    """How to start one SGLang engine and how long to wait for it."""

    model_path: str
    """HF model directory (config, tokenizer, safetensors)."""
    device: str = "cpu"
    """"cpu" (SGLang's torch-native path, with the shims) or "cuda"."""
    tp_size: int = 1
    """Tensor parallel size inside the engine (on CPU, `engines.sglang.engine` says which cores)."""
    dtype: str = "auto"
    """Compute dtype; "float32" for exact log-prob parity on CPU."""
    max_total_tokens: int | None = None
    """KV-cache size in tokens; None lets SGLang size it from free memory."""
    mem_fraction_static: float | None = None
    """Fraction of device memory for weights and KV cache; None is SGLang's default."""
    random_seed: int = 0
    """Engine seed (sampling of requests without their own seed)."""
    log_level: str = "error"
    """SGLang's log level in the engine processes."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Further `sglang.ServerArgs` fields, passed through unchanged (they win over ours, e.g.
    `sleep_on_idle`, which is on by default on CPU: an idle scheduler otherwise spins a core,
    and `skip_tokenizer_init`, on by default: the ranks tokenize and decode themselves)."""
    startup_timeout_s: float = 600.0
    """Limit on engine start (imports, weight load, KV-cache allocation)."""
    call_timeout_s: float = 300.0
    """Limit on every call except generate."""
    generate_timeout_s: float = 3600.0
    """Limit on one `generate` call."""
    progress_every_tokens: int = 0
    """Stream each request and report its tokens to the rank every this many tokens
    (`engines.recovery.progress`); 0: results only when the call returns."""
    process_start: str = "auto"
    """How the host starts SGLang's processes (`EngineConfig.process_start`); `start_method`
    resolves "auto"."""
    cpu_attention: str = "batched"
    """`batched` or `per_request` (`EngineConfig.cpu_attention`); CPU engines only."""
    progress_every_s: float = 0.5
    """At most one progress report per this many seconds (and one when an engine process
    dies)."""
    routing: RoutingCapture | None = None
    """MoE: return each request's routed experts (`moe.routing`); None: not asked."""

    def __post_init__(self):
        require_choice("engine.device", self.device, ("cpu", "cuda"))
        require_int("engine.tp_size", self.tp_size, 1)
        require_choice("engine.process_start", self.process_start, PROCESS_STARTS)
        require_choice("engine.cpu_attention", self.cpu_attention, CPU_ATTENTIONS)
        if self.process_start == "fork" and self.device != "cpu":
            raise ConfigError(
                "engine.process_start", "fork", f"needs engine.device cpu, not {self.device}: a "
                "forked process cannot use CUDA once its parent has", "use spawn or auto",
            )  # fmt: skip
        bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
        if self.device == "cpu" and bind and len(bind.split("|")) < self.tp_size:
            raise ConfigError(
                "engine.tp_size",
                self.tp_size,
                f"on cpu needs one core group per TP rank, but SGLANG_CPU_OMP_THREADS_BIND = "
                f"{bind!r} names the cores of {len(bind.split('|'))} rank(s)",
                "give one '|'-separated group per TP rank (e.g. '0|1'), or unset it to split "
                "the cores evenly",
            )
        for name in ("startup_timeout_s", "call_timeout_s", "generate_timeout_s"):
            require_number(f"engine.{name}", getattr(self, name), gt=0, unit="seconds")
        require_int("engine.progress_every_tokens", self.progress_every_tokens, 0)
        require_number("engine.progress_every_s", self.progress_every_s, ge=0, unit="seconds")

    @property
    def start_method(self) -> str:
        """The `multiprocessing` start method of SGLang's processes: `process_start`, "auto"
        resolved (fork on CPU, spawn on CUDA)."""
        if self.process_start != "auto":
            return self.process_start
        return "fork" if self.device == "cpu" else "spawn"


@dataclass
class FaultsConfig:
    """Faults to inject (all off by default)."""

    allow: bool = False
    """Must be true for any fault below: a recipe never injects one by accident."""
    engine_kill_steps: list[int] = field(default_factory=list)
    """Steps whose generation gets its engine's scheduler killed (SIGKILL) after `delay_s`."""
    engine_hang_steps: list[int] = field(default_factory=list)
    """Steps whose generation gets its engine's scheduler stopped (SIGSTOP) after `delay_s`."""
    engine_kill_in_load_steps: list[int] = field(default_factory=list)
    """For each step k, the first weight load to begin once step k's generation has started
    has its engine killed at once (the transfer dies half way)."""
    engine_kill_probability: float = 0.0
    """Chance, per step and engine, that the step's generation gets its engine killed."""
    delay_s: float = 0.5
    """Seconds after a step's generation starts that a kill or hang lands."""
    seed: int = 0
    """Seed of the random kills (each engine host draws its own stream)."""
    weight_corrupt_versions: list[int] = field(default_factory=list)
    """Versions whose first weight message has one payload byte flipped on arrival, on its
    first attempt (its checksum fails; the sync sends the version again)."""
    reward_hang_steps: list[int] = field(default_factory=list)
    """Steps whose first reward call hangs (needs `reward.call_timeout_s`, which cuts it)."""
    reward_raise_steps: list[int] = field(default_factory=list)
    """Steps whose first reward call raises (scored 0 and counted, or stops the run with
    `reward.on_failure: stop`)."""
    rank_kill_steps: list[int] = field(default_factory=list)
    """Steps at whose start global rank `rank_kill_rank` SIGKILLs itself (on the launcher's
    first attempt only: a run restarted by `torchrun --max-restarts` resumes without it)."""
    rank_kill_rank: int = 0
    """The global rank `rank_kill_steps` kills."""
    router_noise: float = 0.0
    """MoE: the trainer's routers (logp and train passes) choose their top-k on scores plus
    Gaussian noise of this many standard deviations of each token's scores: an induced
    engine/trainer routing mismatch, for measuring routing replay (`moe.replay`). The
    probabilities of the experts used stay the scores'. 0: off."""

    def __post_init__(self) -> None:
        if not isinstance(self.allow, bool):
            raise ConfigError("allow", self.allow, "must be true or false")
        for name in STEP_LISTS:
            steps = getattr(self, name)
            if not isinstance(steps, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps
            ):
                raise ConfigError(name, steps, "must be a list of step numbers (ints >= 0)")
        require_number("engine_kill_probability", self.engine_kill_probability, ge=0, le=1)
        require_number("delay_s", self.delay_s, ge=0, unit="seconds")
        require_int("rank_kill_rank", self.rank_kill_rank, 0)
        require_number("router_noise", self.router_noise, ge=0)
        if self.any() and not self.allow:
            raise ConfigError(
                "allow", self.allow, "must be true for the faults this recipe asks to inject",
                "set faults.allow: true (fault injection is for tests and soak runs)",
            )  # fmt: skip

    def any(self) -> bool:
        return (any(getattr(self, name) for name in STEP_LISTS)
                or bool(self.engine_kill_probability) or bool(self.router_noise))  # fmt: skip

    def engine_faults(self) -> bool:
        """Faults `engines.recovery.faults.EngineFaults` injects (through the engine's hooks)."""
        return bool(self.engine_kill_steps or self.engine_hang_steps
                    or self.engine_kill_in_load_steps or self.engine_kill_probability)  # fmt: skip


STEP_LISTS = (
    "engine_kill_steps", "engine_hang_steps", "engine_kill_in_load_steps",
    "weight_corrupt_versions", "reward_hang_steps", "reward_raise_steps", "rank_kill_steps",
)  # fmt: skip
