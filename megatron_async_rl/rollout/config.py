"""The recipe's `data:`, `rollout:`, `environment:`, `validation:` sections: validated dataclasses.

Owned here: `DatasetConfig` (where the prompts are and how to read them), `RolloutConfig` (how
prompts become samples each step) and `ValidationConfig` (the held-out set and how it is
sampled). Built by the recipe loader (`recipe/schema.py`); read by `rollout.dataset`,
`rollout.generation` and `rollout.validation`, which do the work. Imports only the config
checks and the standard library, so loading a recipe loads neither numpy nor a tokenizer.
Error keys are relative (`num_prompts`); the recipe loader prefixes them
(`validation.num_prompts`).

    data: {path: runs/arith/train.jsonl}
    rollout: {num_prompts_per_step: 8, max_new_tokens: 16}
    environment: {name: tools, tools: [megatron_async_rl.tasks.calculator:add]}
    validation: {data: {path: runs/arith/val.jsonl, shuffle: false}, num_prompts: 64}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_async_rl.config.checks import (
    require_bool,
    require_choice,
    require_int,
    require_number,
)
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.sandbox.config import SandboxConfig

FORMATS = ("auto", "jsonl", "parquet")
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
"""File suffix -> format, for `format: auto`."""


@dataclass
class DatasetConfig:
    """Where the prompts are and how to read them (recipe section `data:`)."""

    path: str
    """A .jsonl or .parquet file; relative paths are relative to the working directory."""
    format: str = "auto"
    """auto (from the file suffix), jsonl or parquet."""
    prompt_key: str = "prompt"
    """Column holding a plain-text prompt."""
    messages_key: str = "messages"
    """Column holding a chat prompt, a list of {role, content}."""
    answer_key: str = "answer"
    """Column holding the ground truth the reward compares against."""
    answer_required: bool = True
    """A row without an answer is a bad row (`missing_answer`): what verifiable rewards
    (`math`, `arithmetic`) need. `false` for rewards that need none (a judge, a reward model):
    such rows reach the reward with answer ""."""
    max_prompt_tokens: int | None = None
    """Rows whose tokenized prompt is longer are bad rows (needs a tokenizer); None: no limit."""
    on_bad_row: str = "skip"
    """skip (log, count, continue) or error (stop with the file, line and reason)."""
    shuffle: bool = True
    """Visit the rows in a fresh seeded permutation every epoch."""
    seed: int = 0
    """Seed of the per-epoch permutations."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("path", self.path, "must be the path of a .jsonl or .parquet file")
        require_choice("format", self.format, FORMATS)
        if self.format == "auto" and Path(self.path).suffix.lower() not in SUFFIXES:
            raise ConfigError(
                "format",
                self.format,
                f"cannot tell the format of {self.path!r} from its suffix",
                "name the file *.jsonl or *.parquet, or set format: jsonl|parquet",
            )
        if not isinstance(self.answer_required, bool):
            raise ConfigError("answer_required", self.answer_required, "must be true or false")
        for key in ("prompt_key", "messages_key", "answer_key"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(key, getattr(self, key), "must be a non-empty column name")
        require_int("max_prompt_tokens", self.max_prompt_tokens, 1, optional=True)
        require_choice("on_bad_row", self.on_bad_row, ("skip", "error"))
        require_bool("shuffle", self.shuffle)
        require_int("seed", self.seed, 0)

    @property
    def resolved_format(self) -> str:
        """jsonl or parquet."""
        return SUFFIXES[Path(self.path).suffix.lower()] if self.format == "auto" else self.format


@dataclass
class RolloutConfig:
    """How prompts become samples each step."""

    num_prompts_per_step: int = 8
    """Prompts per optimizer step; each is sampled algorithm.num_samples_per_prompt times."""
    max_new_tokens: int = 16
    """Response length limit in tokens."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    use_chat_template: bool = False
    """Wrap plain-text prompts in the tokenizer's chat template."""
    ignore_eos: bool = False
    """Never stop at EOS: every response is exactly `max_new_tokens` long. For benchmarks that
    need equal response lengths on both sides of a comparison, not for learning (the model
    is trained on what follows its answer). Single-turn only."""

    def __post_init__(self) -> None:
        require_int("num_prompts_per_step", self.num_prompts_per_step, 1)
        require_int("max_new_tokens", self.max_new_tokens, 1)
        require_number("temperature", self.temperature, ge=0)
        require_number("top_p", self.top_p, gt=0, le=1)
        if self.top_k != -1:
            require_int("top_k", self.top_k, 1, hint="-1 turns top-k off")
        require_bool("use_chat_template", self.use_chat_template)
        require_bool("ignore_eos", self.ignore_eos)


@dataclass
class ValidationConfig:
    """The held-out set and how it is sampled."""

    data: DatasetConfig | None = None
    """The held-out prompts (same format as `data:`); required when validation is on."""
    num_prompts: int | None = None
    """Evaluate the first this-many rows of the file (in file order); None: every row."""
    num_samples_per_prompt: int = 1
    """Responses per prompt; more than 1 makes sense with temperature > 0."""
    max_new_tokens: int | None = None
    """Response length limit; None: rollout.max_new_tokens."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy, the usual choice for evaluation)."""

    def __post_init__(self) -> None:
        require_int("num_prompts", self.num_prompts, 1, optional=True)
        require_int("num_samples_per_prompt", self.num_samples_per_prompt, 1)
        require_int("max_new_tokens", self.max_new_tokens, 1, optional=True)
        require_number("temperature", self.temperature, ge=0)

    def rollout_config(self, rollout: RolloutConfig) -> RolloutConfig:
        """The sampling knobs of a validation pass: the training ones with ours on top."""
        return RolloutConfig(
            num_prompts_per_step=rollout.num_prompts_per_step,
            max_new_tokens=self.max_new_tokens or rollout.max_new_tokens,
            temperature=float(self.temperature),
            top_p=rollout.top_p if self.temperature > 0 else 1.0,
            top_k=rollout.top_k if self.temperature > 0 else -1,
            use_chat_template=rollout.use_chat_template,
        )


SGLANG_TOOL_FORMATS = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32",
    "deepseekv4", "deepseekv41", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon",
    "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse",
    "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3", "step3p5",
    "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hunyuan", "gigachat3",
    "gigachat35", "gemma4", "inkling", "iquest_q1",
)  # fmt: skip
"""SGLang 0.5.23's `FunctionCallParser.ToolCallParserEnum`, less `hermes` (ours) and
`response_template` (not a format of its own): listed here so that a recipe is checked without
importing SGLang (a test holds the list to the installed SGLang's)."""
TOOL_FORMATS = ("hermes", *SGLANG_TOOL_FORMATS)
"""`environment.tool_format`: this project's `hermes`, then SGLang's (`rollout.tool_calls`)."""


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts (`rollout/multiturn.py`): set `name` and every sample is a trajectory
    of model turns and environment observations; absent, generation is single-turn."""

    name: str | None = None
    """`tools` (the built-in tool-calling environment) or `module:Class` (a plug-in with
    `reset(sample)` and `step(action)`); None: single-turn."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a plug-in environment's constructor."""
    tools: list[str] = field(default_factory=list)
    """`module:function` tools the model may call (`name: tools`), described to the chat
    template from their signatures and docstrings."""
    tool_format: str = "hermes"
    """How calls are written: `hermes` (Qwen/Hermes `<tool_call>{json}</tool_call>`, this
    project's parser) or any format of SGLang's `FunctionCallParser` by its name (`llama3`,
    `deepseekv3`, `qwen3_coder`, `gpt-oss`, `kimi_k2`, `glm45`, `mistral`, ...:
    `rollout.tool_calls.FORMATS`)."""
    tool_timeout_s: float = 10.0
    """A tool call past this is cut and answered with an error (it runs in a worker process)."""
    tool_workers: int = 2
    """Worker processes per generate rank that run tool calls."""
    tool_max_chars: int = 4096
    """A tool result longer than this is cut (with a note to the model, counted)."""
    max_turns: int = 4
    """Model turns per trajectory."""
    max_total_tokens: int = 512
    """Tokens after the prompt, model and environment tokens together, per trajectory."""
    step_timeout_s: float = 30.0
    """An environment step (or reset) past this ends its trajectory: reward 0, counted."""
    reward_fn_weight: float = 1.0
    """Weight of the run's `reward:` function on the trajectory's final answer, added to the
    environment's own rewards (0: the environment's rewards alone)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the built-in `python` and `bash` tools' sandbox (`megatron_async_rl.sandbox`)."""

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError("name", self.name, "must be 'tools' or module:Class")
        if not isinstance(self.kwargs, dict):
            raise ConfigError("kwargs", self.kwargs, "must be a mapping")
        if not isinstance(self.tools, list) or not all(isinstance(t, str) for t in self.tools):
            raise ConfigError("tools", self.tools, "must be a list of module:function strings")
        if self.name == "tools" and not self.tools:
            raise ConfigError("tools", self.tools, "the tools environment needs at least one "
                              "tool", "tools: [my_module:my_function]")  # fmt: skip
        if self.tools and self.name != "tools":
            raise ConfigError("tools", self.tools, f"are called by the 'tools' environment, "
                              f"not by name {self.name!r}", "name: tools")  # fmt: skip
        require_choice("tool_format", self.tool_format, TOOL_FORMATS)
        require_number("tool_timeout_s", self.tool_timeout_s, gt=0)
        require_int("tool_workers", self.tool_workers, 1)
        require_int("tool_max_chars", self.tool_max_chars, 16)
        require_int("max_turns", self.max_turns, 1)
        require_int("max_total_tokens", self.max_total_tokens, 1)
        require_number("step_timeout_s", self.step_timeout_s, gt=0)
        require_number("reward_fn_weight", self.reward_fn_weight, ge=0)

    @property
    def multi_turn(self) -> bool:
        return self.name is not None
