"""What a dry run checks beyond the recipe itself, without ranks or engines.

Owned here: `check_run_inputs(cfg)`, called by `train.main` under `--dry-run` (the launchers run
one before any rank starts): the reward resolves (built-in name, or a `module:function` that
imports and has the contract's signature), the environment loads (`check_environment`: tools
and plug-in import, with the arguments the plug-in takes), the prompt files exist and hold
valid rows (data and validation, with the recipe's keys), the tokenizer of `model.hf_path`
loads (with a chat template when `rollout.use_chat_template` asks for one), and the dtype is
one the platform runs end to end (`--bf16` on an explicitly CPU platform is refused). Each
failure is a `ConfigError`: one line, exit 2. Checks that need what this machine lacks (a
cluster checkpoint) are skipped with the warning `recipe.resolve` already gave.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_async_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)


def check_platform_dtype(cfg, device: str) -> None:
    """`--bf16` (or `--fp16`) on a CPU platform: refused, one line (the CPU path runs fp32)."""
    if device != "cpu":
        return
    for role, args in cfg.role_megatron_args.items():
        for flag in ("bf16", "fp16"):
            if args.get(flag):
                raise ConfigError(
                    f"--{flag}", True,
                    f"is not supported on CPU (platform.device cpu; role {role}): the CPU path "
                    "runs and syncs weights in fp32",
                    f"drop --{flag} on CPU, or run on GPUs (platform.device cuda/auto)",
                )  # fmt: skip


def check_run_inputs(cfg, here: bool = False) -> None:
    """Everything a GRPO run reads at start-up that can be checked here (see the module doc).
    `here` (`--dry-run --here`, the launchers): the job runs on this machine, so every path must
    exist; otherwise a prompt file this machine lacks is skipped with a warning."""
    check_platform_dtype(cfg, cfg.platform.device)
    if cfg.trainer.job != "grpo":
        return
    from megatron_async_rl.rewards.registry import get_reward
    from megatron_async_rl.rollout.dataset import PromptDataset

    get_reward(cfg.reward)
    check_environment(cfg.environment)
    tokenizer = _tokenizer(cfg)
    use_template = cfg.rollout.use_chat_template
    validating = cfg.scheduler.validation_every > 0  # the held-out set is read only then
    for key, data in (("data", cfg.data), ("validation.data", cfg.validation.data)):
        if data is None or (key == "validation.data" and not validating):
            continue
        if not here and not Path(data.path).exists():
            logger.warning(
                "%s.path = %r not found on this machine: not checked (dry run; the launchers "
                "check it where the job runs)", key, data.path,
            )  # fmt: skip
            continue
        PromptDataset(data, tokenizer=tokenizer, use_chat_template=use_template, key_prefix=key)


def check_environment(env) -> None:
    """The recipe's `environment:` as the rollout side will load it: each tool of `tools`
    imports, is a module-level function and can be described to the chat template; a plug-in
    (`module:Class`) imports, has reset and step, and takes `kwargs`."""
    if env.name is None:
        return
    if env.name == "tools":
        from megatron_async_rl.rollout.tools import load_tools

        load_tools(env.tools, key="environment.tools")
        check_sandbox(env.tools)
        return
    from megatron_async_rl.rollout.environment import load_environment

    load_environment(env.name, "environment.name", **env.kwargs)


def check_sandbox(tools: list) -> None:
    """Where the built-in `python` or `bash` tool is used, the sandbox runs a program here."""
    from megatron_async_rl.sandbox.run import run_code
    from megatron_async_rl.sandbox.tools import BUILTIN

    used = [t for t in tools if isinstance(t, str) and t in BUILTIN]
    if not used:
        return
    result = run_code("python", "print('ok')")
    if not result.ok or result.stdout != "ok\n":
        lines = result.stderr.strip().splitlines() or [f"exit status {result.exit_code}"]
        why = result.error or lines[-1]
        raise ConfigError(
            "environment.tools", used, f"the sandbox cannot run code on this machine: {why}",
            "install bubblewrap (apt-get install bubblewrap; scripts/setup_env.sh does) on a "
            "kernel that allows user namespaces",
        )  # fmt: skip


def check_batches(cfg, layout) -> None:
    """--global-batch-size against the train role's data-parallel size and micro-batch size
    (Megatron's rule), for the world the dry run plans: the ranks would find it at step 0; with
    --rampup-batch-size or --decrease-batch-size-if-needed, every G the run takes. A role with
    virtual pipeline stages: its micro-batch counts against the interleaved schedule's rules
    (`minibatch.check_role_microbatches`)."""
    if cfg.trainer.job != "grpo" or "train" not in layout.parallelism:
        return
    from megatron_async_rl.algorithms.minibatch import check_minibatches, check_role_microbatches

    batch = cfg.rollout.num_prompts_per_step * cfg.algorithm.num_samples_per_prompt
    for role, role_args in cfg.role_megatron_args.items():  # virtual pipeline stages' passes
        if role in layout.parallelism:
            check_role_microbatches(role, role_args, batch, layout.dp_of(role))
    args = cfg.role_megatron_args["train"]
    gbs = args.get("global_batch_size")
    if gbs is None:
        return
    if args.get("rampup_batch_size") or args.get("decrease_batch_size_if_needed"):
        from megatron_async_rl.algorithms.batch_ramp import check_batch_ramp

        # every G the run reaches, as rounded for this world's data-parallel size
        check_batch_ramp(args, batch, cfg.algorithm.ppo_epochs, layout.dp_of("train"))
        return
    check_minibatches(batch, gbs, int(args.get("micro_batch_size") or 1), layout.dp_of("train"))


def _tokenizer(cfg):
    hf_path = cfg.model.hf_path
    if hf_path is None or not Path(hf_path).is_dir():
        return None  # a cluster checkpoint absent here: resolve() said so already
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_path)
    except Exception as err:  # any failure to load is the user's files: name them
        raise ConfigError(
            "model.hf_path", hf_path, f"its tokenizer does not load: {type(err).__name__}: {err}"
        ) from err
    if cfg.rollout.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "rollout.use_chat_template", True,
            f"the tokenizer of {hf_path} has no chat template",
            "set rollout.use_chat_template: false, or use a chat model",
        )  # fmt: skip
    return tokenizer
