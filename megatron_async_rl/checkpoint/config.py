"""The recipe's `checkpoint:` section: where, how often and how checkpoints are written.

Owned here: `CheckpointConfig`, validated where it is built (`resume` is set by the command
line's `--resume auto|never|PATH`), `PREEMPTED_EXIT_CODE` and `Preempted`. Read by
`checkpoint.manager`. Torch-free, like the rest of the config (the recipe loader imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_async_rl.config.checks import require_bool, require_int
from megatron_async_rl.config.errors import ConfigError

SIGNALS = ("SIGTERM", "SIGUSR1")


@dataclass
class CheckpointConfig:
    """Checkpoints of a run: the train role's model and optimizer, and the pipeline's state."""

    directory: str | None = None
    """Where checkpoints go; None: `<run_dir>/checkpoints`."""
    every_steps: int = 0
    """Save after every this many optimizer steps (policy versions); 0: only on a signal and
    at the end of the run."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    async_save: bool = True
    """The step waits only for a snapshot of the model and optimizer; a forked process writes
    them and the checkpoint is published (manifest, rename) at a later step boundary. false:
    the step waits for the whole save."""
    save_on_signal: list[str] = field(default_factory=lambda: list(SIGNALS))
    """Signals that make every rank save at the next step boundary and exit with
    `PREEMPTED_EXIT_CODE` (what SLURM sends before it kills a job)."""
    save_at_end: bool = True
    """Save after the last step."""
    hf_export_every: int = 0
    """Every this many versions, also export the train role's weights as a HuggingFace
    checkpoint to `<directory>/hf_step_<N>/` (for evaluation; not used to resume), and with a
    critic its weights as a `*ForTokenClassification` one to `hf_step_<N>_critic/`; 0: never."""
    resume: str = "auto"
    """"auto": continue from the newest complete checkpoint in `directory` if there is one;
    "never": start from the HF checkpoint; else the path of one checkpoint (`step_N`). The
    command line's `--resume` sets it."""

    def __post_init__(self) -> None:
        if self.directory is not None and (
            not isinstance(self.directory, str) or not self.directory
        ):
            raise ConfigError("directory", self.directory, "must be a non-empty path or null")
        require_int("every_steps", self.every_steps, 0)
        require_int("keep_last", self.keep_last, 1)
        require_int("hf_export_every", self.hf_export_every, 0)
        require_bool("async_save", self.async_save)
        require_bool("save_at_end", self.save_at_end)
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError("resume", self.resume, "must be auto, never or a checkpoint path")
        if not isinstance(self.save_on_signal, list) or any(
            s not in SIGNALS for s in self.save_on_signal
        ):
            raise ConfigError(
                "save_on_signal", self.save_on_signal, f"must be a list of {', '.join(SIGNALS)}"
            )

    def path(self, run_dir: str) -> str:
        return self.directory or f"{run_dir.rstrip('/')}/checkpoints"


PREEMPTED_EXIT_CODE = 83
"""Exit code of a run that saved on a signal (SLURM requeues on it; `launch/slurm.sbatch`)."""


class Preempted(Exception):
    """Raised by a loop after it saved on a signal: the entry point exits `PREEMPTED_EXIT_CODE`."""


INTERRUPTED_EXIT_CODE = 130
"""Exit code of a run stopped by Ctrl-C (128 + SIGINT, what shells report for it)."""


class Interrupted(Preempted):
    """Raised instead of `Preempted` when the stop came from Ctrl-C (SIGINT) alone: the run
    saved as on a save-and-exit signal, and the entry point exits `INTERRUPTED_EXIT_CODE`."""
