"""The recipe's dataclasses: our own knobs, validated where they are built.

Each dataclass checks its fields in `__post_init__` and raises `ConfigError` naming the field;
`recipe.build_config` builds them from YAML and prefixes the dotted path
(`roles.groups[1].num_ranks`). Megatron's knobs are not modelled here: `megatron:` sections are
dicts validated and normalised by `megatron_flags` (dest names, typed values).

Roles are spelled `train`, `logp`, `ref`, `generate`. The first three run Megatron models and
take `roles.<role>.megatron:` overrides; `generate` is the rollout engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_async_rl.config.errors import ConfigError

if TYPE_CHECKING:
    from megatron_async_rl.distributed.layout import RoleLayout

ROLES = ("train", "logp", "ref", "generate")
MEGATRON_ROLES = ("train", "logp", "ref")


def _require_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, value, "expected an integer")
    if value < minimum:
        raise ConfigError(key, value, f"must be >= {minimum}")


def _require_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, value, f"must be one of {', '.join(choices)}")


def _normalize_megatron(section: Any, key: str) -> dict[str, Any]:
    # Imported here: megatron_flags may load megatron-core's dataclasses on first use.
    from megatron_async_rl.config.megatron_flags import normalize_megatron_section

    return normalize_megatron_section(section, key)


@dataclass
class RoleGroupSpec:
    """One rank window of the world; the roles listed time-share its ranks."""

    roles: list[str]
    """Roles placed on this window, e.g. [logp, train]."""
    num_ranks: int | None = None
    """Ranks in the window. Exactly one of num_ranks and ratio is set."""
    ratio: float | None = None
    """Fraction of the world (or, next to num_ranks groups, of the ranks they leave)."""

    def __post_init__(self) -> None:
        if isinstance(self.roles, tuple):
            self.roles = list(self.roles)
        if not isinstance(self.roles, list) or not self.roles:
            raise ConfigError("roles", self.roles, "must be a non-empty list of role names")
        for index, role in enumerate(self.roles):
            if role not in ROLES:
                raise ConfigError(
                    f"roles[{index}]", role, f"unknown role; roles are {', '.join(ROLES)}"
                )
        duplicates = sorted({r for r in self.roles if self.roles.count(r) > 1})
        if duplicates:
            raise ConfigError("roles", self.roles, f"lists {', '.join(duplicates)} twice")
        if (self.num_ranks is None) == (self.ratio is None):
            raise ConfigError(
                "num_ranks",
                self.num_ranks,
                "set exactly one of num_ranks and ratio",
                f"ratio = {self.ratio}",
            )
        if self.num_ranks is not None:
            _require_int("num_ranks", self.num_ranks, 1)
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
                raise ConfigError("ratio", self.ratio, "expected a number in (0, 1]")
            if not 0 < self.ratio <= 1:
                raise ConfigError("ratio", self.ratio, "must be in (0, 1]")
            self.ratio = float(self.ratio)


@dataclass
class RolesConfig:
    """Where each role runs, and per-role Megatron overrides."""

    groups: list[RoleGroupSpec]
    """Rank windows in rank order: the first starts at rank 0."""
    megatron: dict[str, dict] = field(default_factory=dict)
    """Role -> Megatron args for that role only (recipe `roles.<role>.megatron:`), dest names."""

    def __post_init__(self) -> None:
        if not isinstance(self.groups, list) or not self.groups:
            raise ConfigError("groups", self.groups, "must be a non-empty list of role groups")
        placed: dict[str, int] = {}
        for index, group in enumerate(self.groups):
            if not isinstance(group, RoleGroupSpec):
                raise ConfigError(f"groups[{index}]", group, "expected a RoleGroupSpec")
            for role in group.roles:
                if role in placed:
                    raise ConfigError(
                        f"groups[{index}].roles",
                        group.roles,
                        f"{role} is already placed in groups[{placed[role]}]",
                        "each role runs in exactly one group",
                    )
                placed[role] = index
        if not isinstance(self.megatron, dict):
            raise ConfigError(
                "megatron", self.megatron, "must be a mapping of role -> Megatron args"
            )
        normalized = {}
        for role, section in self.megatron.items():
            if role not in MEGATRON_ROLES:
                raise ConfigError(
                    f"{role}.megatron",
                    section,
                    f"only {', '.join(MEGATRON_ROLES)} take Megatron overrides",
                )
            if role not in placed:
                raise ConfigError(
                    f"{role}.megatron",
                    section,
                    f"role {role} is overridden but not placed in any group",
                    "add it to a roles.groups entry or drop the override",
                )
            normalized[role] = _normalize_megatron(section, f"{role}.megatron")
        self.megatron = normalized
        for role in MEGATRON_ROLES:
            if role not in placed:
                raise ConfigError(
                    "groups",
                    [g.roles for g in self.groups],
                    f"role {role} is not placed",
                    f"every Megatron role ({', '.join(MEGATRON_ROLES)}) needs a group",
                )

    def placed_roles(self) -> tuple[str, ...]:
        """Every placed role, in group order."""
        return tuple(role for group in self.groups for role in group.roles)


@dataclass
class ModelConfig:
    """The model all Megatron roles load."""

    hf_path: str | None = None
    """HuggingFace directory (config.json + *.safetensors); the architecture comes from it.
    A relative path is relative to the working directory. None: architecture from `megatron:`."""

    def __post_init__(self) -> None:
        if self.hf_path is not None and (not isinstance(self.hf_path, str) or not self.hf_path):
            raise ConfigError("hf_path", self.hf_path, "must be a directory path or null")


@dataclass
class PlatformConfig:
    """Device and collective backend; `auto` picks CUDA/NCCL when a GPU is visible."""

    device: str = "auto"
    """auto, cpu or cuda."""
    backend: str = "auto"
    """auto, gloo or nccl (nccl needs cuda)."""

    def __post_init__(self) -> None:
        _require_choice("device", self.device, ("auto", "cpu", "cuda"))
        _require_choice("backend", self.backend, ("auto", "gloo", "nccl"))
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError("backend", self.backend, "nccl needs device cuda", "use gloo on cpu")


@dataclass
class SmokeConfig:
    """The smoke job: one forward pass per Megatron role on a synthetic batch."""

    batch_size: int = 4
    """Sequences in the synthetic batch."""
    seq_length: int = 32
    """Tokens per sequence."""
    seed: int = 1234
    """Seed for the synthetic token ids."""

    def __post_init__(self) -> None:
        _require_int("batch_size", self.batch_size, 1)
        _require_int("seq_length", self.seq_length, 1)
        _require_int("seed", self.seed, 0)


@dataclass(kw_only=True)
class RunConfig:
    """A whole recipe: our knobs plus the shared Megatron section."""

    run_dir: str = "runs/default"
    """Where logs, checkpoints and config.resolved.yaml go."""
    seed: int = 1234
    """Seed for our own randomness (sampling, data order)."""
    platform: PlatformConfig = field(default_factory=PlatformConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    roles: RolesConfig
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    megatron: dict[str, Any] = field(default_factory=dict)
    """Megatron args shared by every Megatron role, dest names (`tensor_model_parallel_size`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ConfigError("run_dir", self.run_dir, "must be a non-empty path")
        _require_int("seed", self.seed, 0)
        self.megatron = _normalize_megatron(self.megatron, "megatron")


@dataclass(kw_only=True)
class ResolvedConfig(RunConfig):
    """A RunConfig plus the fully resolved Megatron args of each placed Megatron role."""

    role_megatron_args: dict[str, dict[str, Any]]
    """Role -> every Megatron arg (dest -> value): defaults < architecture from model.hf_path <
    `megatron:` < `roles.<role>.megatron:` < flags after `--`."""

    def run_config(self) -> RunConfig:
        """This config without the resolved args."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunConfig)}
        return RunConfig(**values)

    def plan_layout(self, world_size: int) -> RoleLayout:
        """The rank layout of this recipe on a world of `world_size` ranks."""
        from megatron_async_rl.distributed.layout import Parallelism, plan_layout

        parallelism = {
            role: Parallelism.from_megatron_args(args)
            for role, args in self.role_megatron_args.items()
        }
        return plan_layout(world_size, self.roles.groups, parallelism)
