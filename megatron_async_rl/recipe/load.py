"""Recipe resolution: YAML file -> `--set` overrides -> Megatron flags -> `ResolvedConfig`.

Precedence, lowest first: defaults < recipe < `--set a.b=c` < Megatron flags after `--`. Inside
Megatron args: defaults < the architecture read from `model.hf_path` (its config.json) < shared
`megatron:` < `roles.<role>.megatron:` < flags (which apply to every Megatron role;
`build_config` folds them into each role's overrides so that the written `config.resolved.yaml`
reproduces the same config on its own).

Owned here: `resolve` (the one call an entry point makes) and `build_config` (a tree and the
flags after `--` into a `ResolvedConfig`). The tree itself (reading the file, `--set`, building
the dataclasses, writing `config.resolved.yaml`) is `recipe.tree`; the optional roles' checks are
`config.role_checks`.

A recipe is our tree plus Megatron sections:

    run_dir: runs/tiny            # RunConfig fields (schema.py)
    platform: {device: cpu}
    model: {hf_path: runs/tiny-llama}
    roles:
      groups:                     # rank windows, in rank order
        - {roles: [train], num_ranks: 2}
        - {roles: [logp, ref], num_ranks: 2}
      train:
        megatron: {tensor_model_parallel_size: 2}
    megatron: {lr: 1.0e-5}        # shared by train, logp and ref

Every mistake raises `ConfigError` naming the dotted key; entry points wrap `resolve` in
`errors.exit_on_config_error`.

Checkpoint paths (`model.hf_path`, `--load`) are checked where the run starts. A dry run
(`check_paths=False`) may validate a cluster recipe on a machine without its checkpoint: a path
that does not exist there is skipped with one warning, and the architecture then comes from the
recipe's `megatron:` sections alone. A missing `model.hf_path` stays an error when the recipe
does not set `ARCHITECTURE_KEYS` itself (it relies on the checkpoint's config.json).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from megatron_async_rl.config import role_checks
from megatron_async_rl.config.errors import NO_VALUE, ConfigError, raise_all
from megatron_async_rl.config.megatron import parse, rules, table
from megatron_async_rl.recipe.schema import MEGATRON_ROLES, ResolvedConfig, RolesConfig, RunConfig
from megatron_async_rl.recipe.tree import apply_overrides, build_dataclass, load_recipe

# The Megatron args a recipe must set itself for a dry run to skip a missing model.hf_path.
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads")

logger = logging.getLogger(__name__)


def _check_hf_path(hf_path: str | None, key: str = "model.hf_path") -> None:
    if hf_path is None:
        return
    path = Path(hf_path)
    hint = f"relative paths start at {Path.cwd()}"
    if not path.is_dir():
        raise ConfigError(key, hf_path, "directory not found", hint)
    if not (path / "config.json").is_file():
        raise ConfigError(key, hf_path, "has no config.json (not a HF model dir)")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(key, hf_path, "has no *.safetensors weights")


def _path_to_check(path: str | None, key: str, check_paths: bool, instead: str) -> str | None:
    """`path`, or None (after one warning) when a dry run cannot see it on this machine."""
    if path is None or check_paths or Path(path).exists():
        return path
    logger.warning(
        "%s = %r not found on this machine: not checked (dry run); %s", key, path, instead
    )
    return None


def hf_architecture(hf_path: str | None) -> dict[str, Any]:
    """The Megatron args (dest -> value) describing the model in `hf_path`'s config.json."""
    if hf_path is None:
        return {}
    _check_hf_path(hf_path)
    from megatron_async_rl.models.hf_config import megatron_args_from_hf

    try:
        hf_config = json.loads((Path(hf_path) / "config.json").read_text())
        args = megatron_args_from_hf(hf_config)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        # unreadable or malformed JSON, or an architecture megatron_args_from_hf cannot map
        raise ConfigError("model.hf_path", hf_path, f"config.json: {err}") from None
    return parse.normalize_megatron_section(args, "model.hf_path:config.json")


def build_config(tree: dict, megatron_argv: list[str], check_paths: bool = True) -> ResolvedConfig:
    """Validate a recipe tree and the flags after `--` into a ResolvedConfig.

    Each Megatron role's args: defaults < the architecture in `model.hf_path` < `megatron:` <
    `roles.<role>.megatron:` < flags. `check_paths=False` (dry run): checkpoint paths missing
    on this machine are skipped with a warning instead of raising.
    """
    flags = parse.parse_megatron_flags(list(megatron_argv))
    tree = _with_flag_owned_keys(tree, flags)
    run = build_dataclass(RunConfig, tree, "")
    placed = [role for role in MEGATRON_ROLES if role in run.roles.placed_roles()]
    overrides = {
        role: {**run.roles.megatron.get(role, {}), **flags}
        for role in placed
        if run.roles.megatron.get(role) or flags
    }
    # A dry run may skip a checkpoint it cannot see only when the recipe gives the architecture.
    gives_architecture = all(
        {**run.megatron, **overrides.get(role, {})}.get(name) is not None
        for role in placed
        if role != "reward_model"  # its architecture is its own checkpoint's
        for name in ARCHITECTURE_KEYS
    )
    hf_path = run.model.hf_path
    if not check_paths and not gives_architecture and hf_path and not Path(hf_path).exists():
        raise ConfigError(
            "model.hf_path",
            hf_path,
            "directory not found",
            "a dry run skips a missing checkpoint only when megatron: sets "
            + ", ".join(ARCHITECTURE_KEYS),
        )
    hf_path = _path_to_check(
        hf_path,
        "model.hf_path",
        check_paths,
        "the architecture comes from the recipe's megatron: sections alone",
    )
    architecture = hf_architecture(hf_path)
    from megatron_async_rl.distributed import pg_options  # pure: the role groups' options

    loads = {}
    resolved = {}
    plans = {}  # role -> its upcycling plan, for the roles that load model.hf_path
    for role in placed:
        given = {**run.megatron, **overrides.get(role, {})}
        own = _role_architecture(run, role, check_paths)
        if own is None:
            plans[role], own = _upcycling(run.model.hf_path, hf_path, architecture, given, role)
        elif given.get("moe_use_upcycling"):
            raise ConfigError(
                "--moe-use-upcycling", True,
                f"upcycles model.hf_path, but role {role} loads its own checkpoint",
                "set it in roles.<role>.megatron: of the roles that load model.hf_path",
            )  # fmt: skip
        own = own or architecture
        args = {**table.defaults(), **own, **given}
        rules.check_args(args, role)
        pg_options.check_group_flags(args, role, must_exist=check_paths)
        _matches_checkpoint(own, args, role)
        _megatron_lm_derived(args)
        # --load names the weights a role starts from: a HuggingFace directory for now
        # (Megatron distributed checkpoints arrive with resumable checkpointing).
        load = args.get("load")
        if load not in loads:
            loads[load] = _path_to_check(load, "--load", check_paths, "weights not checked")
        _check_hf_path(loads[load], key="--load")
        resolved[role] = args
    if len(set(plans.values())) > 1:
        raise ConfigError(
            "--moe-use-upcycling", {role: plan or "off" for role, plan in plans.items()},
            "must upcycle model.hf_path alike for every role that loads it: one MoE checkpoint "
            "serves them and the engines",
            "set the upcycling flags in megatron: or after --, not in roles.<role>.megatron:",
        )  # fmt: skip
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(RunConfig)}
    fields["roles"] = RolesConfig(groups=run.roles.groups, megatron=overrides)
    fields["trainer"] = dataclasses.replace(
        run.trainer, num_steps=_num_steps(tree, run, resolved["train"], flags)
    )
    fields["algorithm"] = _with_old_logprobs(run, resolved["train"])
    resolved_config = ResolvedConfig(**fields, role_megatron_args=resolved)
    resolved_config.collective_timeout_s()  # the keys that set it agree
    role_checks.check_routing_replay(run.moe.routing_replay, resolved, run.roles.placed_roles())
    if run.reward_model is not None and Path(run.reward_model.hf_path).is_dir():
        policy = run.model.hf_path
        role_checks.check_reward_model(run.reward_model.hf_path,
                            policy if policy and Path(policy).is_dir() else None)  # fmt: skip
    return resolved_config


def _with_old_logprobs(run: RunConfig, train_args: dict[str, Any]):
    """`algorithm` with `old_logprobs` resolved (`algorithms.passes.resolve_old_logprobs`)."""
    from megatron_async_rl.algorithms import minibatch, passes

    algo = run.algorithm
    steps = minibatch.optimizer_steps_per_rl_step(
        run.rollout.num_prompts_per_step * algo.num_samples_per_prompt,
        train_args.get("global_batch_size"), algo.ppo_epochs,
    )  # fmt: skip
    if train_args.get("rampup_batch_size") is not None or \
            train_args.get("decrease_batch_size_if_needed"):  # fmt: skip
        steps = max(steps, 2)  # G changes along the run: not one step per RL step throughout
    mode = passes.resolve_old_logprobs(
        algo, run.roles.placed_roles(), run.scheduler.generate_ahead_steps, steps,
        run.moe.routing_replay,
    )  # fmt: skip
    return dataclasses.replace(algo, old_logprobs=mode)


def _upcycling(
    configured: str | None, hf_path: str | None, architecture: dict, given: dict, role: str
) -> tuple[Any, dict[str, Any]]:
    """(plan, architecture) of a role that loads model.hf_path (`configured`; `hf_path`: None
    where a dry run cannot read it): with --moe-use-upcycling, the plan (`models/upcycle.py`)
    and the architecture of the MoE model upcycled from the dense one, which train.py writes at
    start and every role and engine loads; else (None, the checkpoint's architecture)."""
    if "moe_use_upcycling" not in given and "moe_upcycling_granularity" not in given:
        return None, architecture
    from megatron_async_rl.models import upcycle

    if given.get("moe_use_upcycling") and configured is None:
        raise ConfigError("model.hf_path", None, "--moe-use-upcycling upcycles a dense HF "
                          "checkpoint", "set model.hf_path to it")  # fmt: skip
    dense = json.loads((Path(hf_path) / "config.json").read_text()) if hf_path else None
    args = {**table.defaults(), **architecture, **given}
    plan = upcycle.plan_upcycling(args, dense, role)
    return plan, architecture if plan is None else {**architecture, **plan.moe_args()}


def _role_architecture(run: RunConfig, role: str, check_paths: bool) -> dict[str, Any] | None:
    """A role's own checkpoint architecture: the reward model's (`reward_model.hf_path`), a
    critic started from another checkpoint (`critic.init`); None: the policy's."""
    if role == "reward_model" and run.reward_model is not None:
        path, key = run.reward_model.hf_path, "reward_model.hf_path"
    elif role == "critic" and run.critic.init != "policy":
        path, key = run.critic.init, "critic.init"
    else:
        return None
    path = _path_to_check(path, key, check_paths, "the architecture comes from megatron:")
    _check_hf_path(path, key=key)
    return hf_architecture(path)


# What model.hf_path's config.json says that the engines build too: a Megatron arg that changes
# it would make the trainer's model differ from the engines' (or not load at all).
_CHECKPOINT_DEFINES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "num_query_groups", "kv_channels", "swiglu", "normalization",
    "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
    "rotary_interleaved", "untie_embeddings_and_output_weights", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "vocab_size", "num_experts", "moe_ffn_hidden_size",
    "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_num_groups",
    "moe_router_group_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
    "mscale_all_dim", "original_max_position_embeddings", "beta_fast", "beta_slow",
)  # fmt: skip
# Megatron args the HF config has no word for, whose non-default values change the numerics.
_CHECKPOINT_EXCLUDES = (
    "use_rope_scaling",
    "squared_relu",
    "quick_geglu",
    "layernorm_zero_centered_gamma",
    "apply_residual_connection_post_layernorm",
    "rotary_seq_len_interpolation_factor",
)


def _matches_checkpoint(architecture: dict, args: dict, role: str) -> None:
    """Refuse a Megatron arg that changes the architecture `model.hf_path` defines."""
    if not architecture:
        return
    defaults = table.defaults()
    for name in _CHECKPOINT_DEFINES:
        if name in architecture and args.get(name) != architecture[name]:
            raise ConfigError(
                "--" + name.replace("_", "-"), args.get(name),
                f"differs from model.hf_path's config.json ({architecture[name]!r}; role {role}): "
                "the engines build that architecture",
                "drop the flag (the checkpoint defines it)",
            )  # fmt: skip
    for name in _CHECKPOINT_EXCLUDES:
        if args.get(name) not in (None, defaults.get(name)):
            raise ConfigError(
                "--" + name.replace("_", "-"), args.get(name),
                f"model.hf_path's config.json has no such feature (role {role}): the engines "
                "would compute without it",
                "drop the flag",
            )  # fmt: skip


def _megatron_lm_derived(args: dict[str, Any]) -> None:
    """Fill what Megatron-LM derives when a flag is absent: --ffn-hidden-size from the hidden
    size (4h, or the SwiGLU 2/3 of it rounded down to a multiple of 64) and --moe-ffn-hidden-size
    from it."""
    if args.get("ffn_hidden_size") is None:
        hidden = args["hidden_size"]
        args["ffn_hidden_size"] = (
            int(4 * hidden * 2 / 3 / 64) * 64 if args["swiglu"] else 4 * hidden
        )
    if args.get("num_experts") is not None and args.get("moe_ffn_hidden_size") is None:
        args["moe_ffn_hidden_size"] = args["ffn_hidden_size"]


def _note(message: str, *args: Any) -> None:
    """An INFO line about how the config resolved, printed once per run."""
    if parse.reports_config_notes():
        logger.info(message, *args)


def _given(tree: dict, path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return NO_VALUE
        node = node[part]
    return node


def _put(tree: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _with_flag_owned_keys(tree: dict, flags: parse.ParsedFlags) -> dict:
    """The recipe tree with the keys that Megatron flags own or alias set from them.

    One owner per knob: a recipe key and the Megatron argument that mean the same thing must
    agree when both are given (`--grpo-group-size` / `algorithm.num_samples_per_prompt`,
    `--seed` / `seed`, `--micro-batch-size` / `trainer.micro_batch_size`, `--save` /
    `checkpoint.directory`). Our own seeds (`seed`, `data.seed`) follow Megatron's `--seed`
    unless the recipe sets them.
    """
    tree = copy.deepcopy(tree)
    shared = parse.normalize_megatron_section(tree.get("megatron"), "megatron")
    megatron_args = {**shared, **flags}
    sets = dict(flags.recipe_sets)
    for dest, path in (("seed", "seed"), ("micro_batch_size", "trainer.micro_batch_size"),
                       ("save", "checkpoint.directory")):  # fmt: skip
        if megatron_args.get(dest) is not None:
            origin = f"--{dest.replace('_', '-')}" if dest in flags else f"megatron.{dest}"
            sets[path] = (megatron_args[dest], origin)
    errors = []
    for path, (value, origin) in sets.items():
        if isinstance(value, str):
            value = yaml.safe_load(value)
        given = _given(tree, path)
        if given is not NO_VALUE and given is not None and given != value:
            if origin.startswith("--"):  # a flag after --: the highest precedence
                _note("%s = %s sets %s (the recipe's %s is overridden)", origin, value,
                            path, given)  # fmt: skip
            else:  # two spellings of one knob in the same recipe
                errors.append(ConfigError(
                    path, given, f"disagrees with {origin} = {value} (the same knob)",
                    "set one of them (or both to the same value)",
                ))  # fmt: skip
        _put(tree, path, value)
    mbs = _given(tree, "trainer.micro_batch_size")
    if mbs not in (NO_VALUE, None) and megatron_args.get("micro_batch_size") is None:
        # the shared Megatron value every role inherits; roles.<role>.megatron may override it
        tree["megatron"] = {**(tree.get("megatron") or {}), "micro_batch_size": mbs}
    _exit_signal(tree, megatron_args, errors)
    every = _given(tree, "checkpoint.every_steps")
    if megatron_args.get("save_interval") and every not in (NO_VALUE, None, 0):
        errors.append(ConfigError(
            "checkpoint.every_steps", every,
            f"and --save-interval = {megatron_args['save_interval']} both set the checkpoint "
            "cadence (versions vs optimizer steps)", "set one of them",
        ))  # fmt: skip
    raise_all(errors)
    seed = tree.get("seed", table.defaults()["seed"])
    for section in ("data", "validation.data"):
        data = _given(tree, section)
        if isinstance(data, dict) and data.get("seed") is None:
            data["seed"] = seed
    return tree


def _exit_signal(tree: dict, megatron_args: dict, errors: list) -> None:
    """Megatron-LM's --exit-signal-handler [--exit-signal S] (default SIGTERM): S must be one
    of the signals the run saves and stops on (`checkpoint.save_on_signal`)."""
    from megatron_async_rl.checkpoint.config import SIGNALS

    name = megatron_args.get("exit_signal")
    if not megatron_args.get("exit_signal_handler") and name in (None, "SIGTERM"):
        return
    name = name or "SIGTERM"
    if name not in SIGNALS:
        errors.append(ConfigError("--exit-signal", name, f"must be one of {', '.join(SIGNALS)}",
                                  "the signals checkpoint.save_on_signal can catch"))  # fmt: skip
        return
    given = _given(tree, "checkpoint.save_on_signal")
    if given is NO_VALUE or given is None:
        _put(tree, "checkpoint.save_on_signal", sorted({*SIGNALS, name}))
    elif isinstance(given, list) and name not in given:
        errors.append(ConfigError(
            "checkpoint.save_on_signal", given, f"does not catch --exit-signal {name}",
            f"add {name} to the list",
        ))  # fmt: skip


def _num_steps(tree: dict, run: RunConfig, train_args: dict[str, Any], flags: dict) -> int:
    """RL steps of the run: `trainer.num_steps`, or from `--train-iters` / `--train-samples`
    (Megatron-LM counts optimizer steps; one RL step runs `optimizer_steps_per_rl_step`). Given
    as flags after `--` they override the recipe's `trainer.num_steps`; in the recipe's
    `megatron:` sections they must agree with it."""
    from megatron_async_rl.algorithms.minibatch import optimizer_steps_per_rl_step

    iters, samples = train_args.get("train_iters"), train_args.get("train_samples")
    batch = run.rollout.num_prompts_per_step * run.algorithm.num_samples_per_prompt
    gbs = train_args.get("global_batch_size")
    if run.trainer.job == "grpo":  # --global-batch-size must split the rollout batch
        optimizer_steps_per_rl_step(batch, gbs, run.algorithm.ppo_epochs)
        if train_args.get("rampup_batch_size") or train_args.get("decrease_batch_size_if_needed"):
            from megatron_async_rl.algorithms import batch_ramp  # megatron-core's calculator

            batch_ramp.check_batch_ramp(train_args, batch, run.algorithm.ppo_epochs)
    if iters is None and samples is None:
        return run.trainer.num_steps
    if iters is not None and samples is not None:
        raise ConfigError("--train-samples", samples, "cannot be combined with --train-iters")
    if samples is not None:
        flag, iters = "--train-samples", -(-samples // (gbs or batch))
    else:
        flag = "--train-iters"
    per_step = optimizer_steps_per_rl_step(batch, gbs, run.algorithm.ppo_epochs)
    num_steps = -(-iters // per_step)
    given = _given(tree, "trainer.num_steps")
    from_flag = flag.lstrip("-").replace("-", "_") in flags
    if given is not NO_VALUE and given != num_steps and from_flag:
        _note("%s = %s sets trainer.num_steps = %d (the recipe's %s is overridden)", flag,
                    samples or iters, num_steps, given)  # fmt: skip
    elif given is not NO_VALUE and given != num_steps:
        raise ConfigError(
            "trainer.num_steps", given,
            f"disagrees with {flag} = {samples or iters}: {num_steps} RL steps of "
            f"{per_step} optimizer step(s) each",
            "set one of them",
        )  # fmt: skip
    return num_steps


def resolve(
    config_path: str | Path,
    sets: list[str],
    megatron_argv: list[str],
    run_dir_override: str | None = None,
    check_paths: bool = True,
) -> ResolvedConfig:
    """Load, override and validate a recipe: the one call an entry point makes.

    `check_paths=False` is for dry runs: see `build_config`.
    """
    tree = load_recipe(config_path)
    apply_overrides(tree, list(sets or []))
    if run_dir_override is not None:
        tree["run_dir"] = run_dir_override
    return build_config(tree, list(megatron_argv or []), check_paths)
