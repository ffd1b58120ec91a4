"""The recipe's dataclasses: our own knobs, validated where they are built.

Each dataclass checks its fields in `__post_init__` and raises `ConfigError` naming the field;
`recipe.tree.build_dataclass` builds them from YAML and prefixes the dotted path
(`roles.groups[1].num_ranks`). Megatron's knobs are not modelled here: `megatron:` sections are
dicts validated and normalised by `config.megatron.parse` (dest names, typed values).

Roles are spelled `train`, `logp`, `ref`, `generate`. The first three run Megatron models and
take `roles.<role>.megatron:` overrides; `generate` is the rollout engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_async_rl.algorithms.config import (
    GRPOConfig,
    check_overlong_budget,
    response_budget,
)
from megatron_async_rl.algorithms.critic_config import CriticConfig
from megatron_async_rl.checkpoint.config import CheckpointConfig
from megatron_async_rl.config.checks import require_choice, require_int, require_number
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.roles import (  # noqa: F401 - re-exported
    MEGATRON_ROLES,
    REQUIRED_MEGATRON_ROLES,
    ROLES,
    RoleGroupSpec,
)
from megatron_async_rl.engines.config import EngineConfig, FaultsConfig
from megatron_async_rl.moe.config import MoEConfig
from megatron_async_rl.observability.config import ObservabilityConfig
from megatron_async_rl.rewards.config import RewardConfig, RewardModelConfig
from megatron_async_rl.rollout.config import (
    DatasetConfig,
    EnvironmentConfig,
    RolloutConfig,
    ValidationConfig,
)
from megatron_async_rl.scheduler.config import SchedulerConfig
from megatron_async_rl.weight_sync.config import WeightSyncConfig

if TYPE_CHECKING:
    from megatron_async_rl.distributed.layout import RoleLayout


def _normalize_megatron(section: Any, key: str) -> dict[str, Any]:
    # Imported here: the flag table may load megatron-core's dataclasses on first use.
    from megatron_async_rl.config.megatron.parse import normalize_megatron_section

    return normalize_megatron_section(section, key)


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
        for role in REQUIRED_MEGATRON_ROLES:
            if role not in placed:
                raise ConfigError(
                    "groups",
                    [g.roles for g in self.groups],
                    f"role {role} is not placed",
                    f"every one of {', '.join(REQUIRED_MEGATRON_ROLES)} needs a group",
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
    timeout_s: float | None = None
    """Seconds a collective may wait before torch.distributed fails it, on every group the
    layout builds (start-up waits included: model loading). None (the default): Megatron's
    `--distributed-timeout-minutes` where given, else `scheduler.stage_timeout_s`, so a peer that
    hangs inside a collective is reported within the same bound as any other wait. The world
    group (start-up barriers) waits at least `engine.startup_timeout_s` more."""

    def __post_init__(self) -> None:
        require_choice("device", self.device, ("auto", "cpu", "cuda"))
        require_choice("backend", self.backend, ("auto", "gloo", "nccl"))
        require_number("timeout_s", self.timeout_s, gt=0, unit="seconds", optional=True)
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError("backend", self.backend, "nccl needs device cuda", "use gloo on cpu")


@dataclass
class SmokeConfig:
    """The synthetic batch of the role_check job (`trainer.job: role_check`): every Megatron
    role scores it once (recipe section `smoke:`)."""

    batch_size: int = 4
    """Sequences in the synthetic batch."""
    seq_length: int = 32
    """Tokens per sequence."""
    seed: int = 1234
    """Seed for the synthetic token ids."""

    def __post_init__(self) -> None:
        require_int("batch_size", self.batch_size, 1)
        require_int("seq_length", self.seq_length, 1)
        require_int("seed", self.seed, 0)


JOBS = ("auto", "grpo", "role_check")


@dataclass
class TrainerConfig:
    """What the run does and for how long."""

    job: str = "auto"
    """grpo (the RL loop), role_check (every Megatron role loads the checkpoint and scores one
    batch; no engines) or auto: grpo when the recipe has a `data:` section, else role_check."""
    num_steps: int = 20
    """Optimizer steps (policy versions) to train."""
    micro_batch_size: int | None = None
    """Samples per forward/backward micro-batch; None: Megatron's --micro-batch-size."""

    def __post_init__(self) -> None:
        require_choice("job", self.job, JOBS)
        require_int("num_steps", self.num_steps, 1)
        require_int("micro_batch_size", self.micro_batch_size, 1, optional=True)


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
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DatasetConfig | None = None
    """The prompt dataset (needed by the grpo job)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn, tool-using rollouts (absent: single-turn)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: GRPOConfig = field(default_factory=GRPOConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model (`critic` role): GAE, value loss, warm-up (`algorithms.ppo`)."""
    reward_model: RewardModelConfig | None = None
    """A learned reward model (`reward_model` role) and its weight next to `reward:`'s."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """MoE routing replay (R3/R2) and routing metrics; MoE models only."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Bucket sizes of the weight reshard into the engines (memory bound per sync)."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """The held-out set evaluated every `scheduler.validation_every` versions."""
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    """What the run writes for people to read (rollout dumps)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming (the train role's model and optimizer, the pipeline's state)."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """Faults injected on purpose to test recovery; off, and refused without `allow: true`."""
    megatron: dict[str, Any] = field(default_factory=dict)
    """Megatron args shared by every Megatron role, dest names (`tensor_model_parallel_size`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ConfigError("run_dir", self.run_dir, "must be a non-empty path")
        require_int("seed", self.seed, 0)
        self.megatron = _normalize_megatron(self.megatron, "megatron")
        if self.trainer.job == "auto":
            self.trainer.job = "grpo" if self.data is not None else "role_check"
        if self.trainer.job == "grpo":
            if self.data is None:
                raise ConfigError(
                    "data",
                    None,
                    "the grpo job needs a prompt dataset",
                    "add data: {path: prompts.jsonl}",
                )
            if "generate" not in self.roles.placed_roles():
                raise ConfigError(
                    "roles.groups",
                    "no generate role",
                    "the grpo job needs generate ranks for its SGLang engines",
                )
            if self.model.hf_path is None:
                raise ConfigError(
                    "model.hf_path",
                    None,
                    "the grpo job needs a HF checkpoint (the engines load it)",
                )
        if (
            self.weight_sync.bridge == "device"
            and self.engine.tp_size > 1
            and self.platform.device != "cpu"
        ):
            raise ConfigError(
                "weight_sync.bridge", "device",
                f"engines of engine.tp_size {self.engine.tp_size} take weights from host "
                "memory: on the device bridge every engine TP rank would map its host's GPU "
                "buffer over CUDA IPC (a second CUDA context on that GPU, peer copies)",
                hint="set weight_sync.bridge: auto (or host), or engine.tp_size: 1",
            )  # fmt: skip
        for index, group in enumerate(self.roles.groups):
            shared = "generate" in group.roles and len(group.roles) > 1
            if shared and self.platform.device != "cpu" and self.engine.mem_fraction_static is None:
                raise ConfigError(
                    "engine.mem_fraction_static", None,
                    f"roles.groups[{index}] puts generate on the ranks of {list(group.roles)}: "
                    "on GPUs its engine starts after their models and optimizer are resident, "
                    "and SGLang's default sizes its pool as if the GPU were its own",
                    hint="set engine.mem_fraction_static to the share of GPU memory the "
                    "engine may take (weights plus KV cache), or give generate its own ranks",
                )  # fmt: skip
        if self.scheduler.use_async_loop:
            for index, group in enumerate(self.roles.groups):
                if "generate" in group.roles and len(group.roles) > 1:
                    raise ConfigError(
                        f"roles.groups[{index}].roles",
                        group.roles,
                        "the asynchronous loop needs generate ranks of their own (engines run "
                        "ahead while the Megatron roles train)",
                        "give generate its own group, or use scheduler.generate_ahead_steps: 0",
                    )
        if self.faults.reward_hang_steps and self.reward.call_timeout_s is None:
            raise ConfigError(
                "faults.reward_hang_steps", self.faults.reward_hang_steps,
                "an injected reward hang needs reward.call_timeout_s (nothing else cuts it)",
                "set reward.call_timeout_s, e.g. 5",
            )  # fmt: skip
        if self.scheduler.validation_every > 0 and self.validation.data is None:
            raise ConfigError(
                "validation.data",
                None,
                f"scheduler.validation_every is {self.scheduler.validation_every}: "
                "validation needs a held-out set",
                "add validation: {data: {path: val.jsonl}} or set validation_every: 0",
            )
        check_overlong_budget(self.algorithm, *response_budget(self))
        self._check_value_roles()
        if self.rollout.ignore_eos and self.environment.multi_turn:
            raise ConfigError(
                "rollout.ignore_eos", True,
                f"environment.name is {self.environment.name!r}: a multi-turn episode ends a "
                "turn at EOS or a stop sequence, which ignore_eos turns off",
                "set rollout.ignore_eos: false",
            )  # fmt: skip
        if self.scheduler.validation_every > 0 and self.environment.multi_turn:
            raise ConfigError(
                "scheduler.validation_every", self.scheduler.validation_every,
                f"validation passes are single-turn, and environment.name is "
                f"{self.environment.name!r}: its held-out score would ignore the environment",
                "set scheduler.validation_every: 0 (the training reward is the trajectories')",
            )  # fmt: skip


    def _check_value_roles(self) -> None:
        """A ref role where a KL term needs it; a critic role exactly when advantages are GAE's;
        a reward_model role exactly when the recipe has a `reward_model:` section, and then no
        refill."""
        placed = self.roles.placed_roles()
        if self.algorithm.kl_coef > 0 and "ref" not in placed:
            raise ConfigError(
                "algorithm.kl_coef", self.algorithm.kl_coef,
                f"the KL term (in the {self.algorithm.kl_mode}) needs the reference policy's "
                "log-probs, and no ref role is placed",
                "add ref to a group (e.g. [train, logp, ref]), or set algorithm.kl_coef: 0",
            )  # fmt: skip
        gae = self.algorithm.advantage_estimator == "gae"
        if gae and "critic" not in placed:
            raise ConfigError(
                "algorithm.advantage_estimator", "gae",
                "needs a critic role (PPO's value model) in roles.groups",
                "add critic to a group, e.g. {roles: [critic], num_ranks: 1}",
            )  # fmt: skip
        if "critic" in placed and not gae:
            raise ConfigError(
                "roles.groups", [g.roles for g in self.roles.groups],
                f"place a critic, and algorithm.advantage_estimator is "
                f"{self.algorithm.advantage_estimator!r}: its values would be unused",
                "set algorithm.advantage_estimator: gae, or drop the critic",
            )  # fmt: skip
        if ("reward_model" in placed) != (self.reward_model is not None):
            key, value = ("reward_model", None) if "reward_model" in placed else (
                "roles.groups", [g.roles for g in self.roles.groups])  # fmt: skip
            raise ConfigError(
                key, value,
                "a reward_model role needs the reward_model: section (its checkpoint) and the "
                "section needs the role",
                "add both, e.g. reward_model: {hf_path: my-rm} and a group with reward_model",
            )  # fmt: skip
        if self.reward_model is not None and self.algorithm.refill:
            raise ConfigError(
                "algorithm.refill", True,
                "refill decides on the engine hosts, on the reward: function's values, before "
                "the reward model scores the samples: groups its scores tell apart would be "
                "dropped (with reward_model.rule_weight 0, every group)",
                "set algorithm.refill: false (algorithm.dynamic_filtering then filters on the "
                "combined reward, on the learn side)",
            )  # fmt: skip


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

    def _timeout_flag_s(self, dest: str, per: float) -> float | None:
        values = {
            args[dest] for args in self.role_megatron_args.values() if args.get(dest) is not None
        }
        if len(values) > 1:
            raise ConfigError(
                "--" + dest.replace("_", "-"), sorted(values),
                "must be the same for every role (one world, one collective timeout)",
            )  # fmt: skip
        return per * values.pop() if values else None

    def collective_timeout_s(self) -> tuple[float, str]:
        """Seconds a collective may wait (every process group) once the run is up, and the key
        it comes from: `platform.timeout_s`, else Megatron's
        `--distributed-timeout-seconds-after-init`, else `--distributed-timeout-minutes`, else
        `scheduler.stage_timeout_s`. Raises ConfigError when two of them disagree."""
        after_init = self._timeout_flag_s("distributed_timeout_seconds_after_init", 1.0)
        minutes_s = self._timeout_flag_s("distributed_timeout_minutes", 60.0)
        flag, flag_s = (
            ("--distributed-timeout-seconds-after-init", after_init)
            if after_init is not None
            else ("--distributed-timeout-minutes", minutes_s)
        )
        explicit = self.platform.timeout_s
        if explicit is not None and flag_s is not None and explicit != flag_s:
            raise ConfigError(
                "platform.timeout_s", explicit, f"disagrees with {flag} ({flag_s:g} s)",
                "set only one",
            )  # fmt: skip
        if explicit is not None:
            return float(explicit), "platform.timeout_s"
        if flag_s is not None:
            return flag_s, flag
        return float(self.scheduler.stage_timeout_s), "scheduler.stage_timeout_s"

    def startup_timeout_s(self) -> float:
        """Seconds the world's start-up collectives may wait (barriers that wait for engines):
        the collective timeout, or Megatron's --distributed-timeout-minutes where
        --distributed-timeout-seconds-after-init sets the later one (Megatron-LM's init timeout),
        whichever is longer, plus `engine.startup_timeout_s`."""
        init_s = self._timeout_flag_s("distributed_timeout_minutes", 60.0) or 0.0
        return max(init_s, self.collective_timeout_s()[0]) + self.engine.startup_timeout_s

    def plan_layout(self, world_size: int, ranks_per_node: int | None = None) -> RoleLayout:
        """The rank layout of this recipe on a world of `world_size` ranks (engines of
        `engine.tp_size` ranks; none across two nodes when `ranks_per_node` is given)."""
        from megatron_async_rl.distributed.layout import Parallelism, plan_layout

        parallelism = {
            role: Parallelism.from_megatron_args(args)
            for role, args in self.role_megatron_args.items()
        }
        return plan_layout(
            world_size, self.roles.groups, parallelism, self.engine.tp_size, ranks_per_node
        )
