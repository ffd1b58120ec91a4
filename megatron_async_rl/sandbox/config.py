"""The limits of one sandboxed run (`environment.sandbox:` in a recipe): validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_async_rl.config.checks import require_int, require_number


@dataclass(frozen=True)
class SandboxConfig:
    cpu_s: float = 5.0
    """CPU seconds of the program (every process it starts counts against its own; RLIMIT_CPU)."""
    wall_s: float = 10.0
    """Wall seconds, then the whole process tree is killed."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS)."""
    max_processes: int = 32
    """Processes (and threads) the program may run at once."""
    max_output_bytes: int = 65536
    """stdout and stderr together; past it the program is killed and the output cut."""
    max_file_mb: int = 16
    """Largest file it may write in its private temporary directory (RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        require_number("cpu_s", self.cpu_s, gt=0, unit="seconds")
        require_number("wall_s", self.wall_s, gt=0, unit="seconds")
        require_int("memory_mb", self.memory_mb, 64)
        require_int("max_processes", self.max_processes, 1)
        require_int("max_output_bytes", self.max_output_bytes, 1)
        require_int("max_file_mb", self.max_file_mb, 1)
