"""Megatron-LM-style flags, derived from megatron-core's config dataclasses.

megatron-core's PyPI package has no `megatron.training` argument parser, so the flags are built
here. Most come from walking the fields of `TransformerConfig` (which inherits
`ModelParallelConfig`), `OptimizerConfig` and `DistributedDataParallelConfig`: every field typed
int, float, str, bool, `Optional` of those or a `Literal` of strings becomes `--field-name` with
its type and default (a field typed "X or a list of X" takes one X). A bool that defaults to
False is a `store_true` flag (`--sequence-parallel`); one that defaults to True gets a `--no-`
negative (`--no-async-tensor-model-parallel-allreduce`), as Megatron-LM does. Fields of other
types (callables, dtypes, enums, lists) are skipped. Megatron-LM's own names that differ from the
dataclasses come from the two documented tables below.

Values are keyed by `dest` (argparse's name, underscores): `tensor_model_parallel_size: 2`.
`coerce` types one value; `config.megatron.parse` reads the flags after `--` and the recipe's
`megatron:` sections with it. Cross-field rules live in `config.megatron.rules`, and
`config.megatron.core_kwargs` turns a resolved dict into constructor kwargs for megatron-core.

Importing megatron-core takes seconds, so the derived table is cached in memory and on disk
(`$MEGATRON_ASYNC_RL_CACHE_DIR`, default `~/.cache/megatron_async_rl`), keyed by the
megatron-core version and this file's hash; a config error is then reported without that import.
Callers: `recipe.load` (recipes), `config.megatron.parse`, `config.megatron.rules` and
`config.megatron.core_kwargs`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_async_rl.config.checks import require_bool
from megatron_async_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "MEGATRON_ASYNC_RL_CACHE_DIR"

_SCALAR_TYPES = {int: "int", float: "float", str: "str", bool: "bool"}


@dataclass(frozen=True)
class ArgSpec:
    """One Megatron argument: its dest name, value type and default."""

    dest: str
    type: Literal["int", "float", "str", "bool", "int_list", "str_list"]
    default: Any
    choices: tuple[str, ...] | None = None
    """Allowed values for a str argument (from a `Literal` annotation or Megatron-LM's choices)."""
    nullable: bool = False
    """Whether null (None) is a legal value, e.g. `--num-query-groups` unset."""
    source: str = "Megatron-LM"
    """The megatron-core dataclass the argument was derived from, or Megatron-LM for aliases."""


@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag and the dest it writes."""

    flag: str
    dest: str
    const: bool | None = None
    """None: the flag takes a value. True/False: a bare flag storing that value."""


# Dataclass fields Megatron-LM exposes under another name: dropped from the derived table, the
# alias below carries the Megatron-LM spelling and the *_kwargs functions translate it back.
RENAMED = {"num_moe_experts": "num_experts", "layernorm_epsilon": "norm_epsilon"}

# TransformerConfig uses 0 to mean "not set" for these; Megatron-LM uses None (unset). Keeping
# None lets the model's HF config fill them and lets checks tell "unset" from a bad value.
_UNSET_DEFAULTS = ("num_layers", "hidden_size", "num_attention_heads")

# Megatron-LM arguments that are not megatron-core dataclass fields (or are, under another name).
# Each gets `--dest-with-dashes` (a bare flag when it is a bool).
_MEGATRON_LM_ARGS = (
    # SwiGLU MLP: gated_linear_unit=True and activation_func=silu in TransformerConfig.
    ArgSpec("swiglu", "bool", False),
    # Megatron-LM reads --num-query-groups only when this is set; otherwise attention is MHA.
    ArgSpec("group_query_attention", "bool", False),
    # TransformerConfig.num_moe_experts; None means a dense model.
    ArgSpec("num_experts", "int", None, nullable=True),
    # GPTModel(share_embeddings_and_output_weights=not untie_embeddings_and_output_weights).
    ArgSpec("untie_embeddings_and_output_weights", "bool", False),
    # GPTModel(position_embedding_type=...); Megatron-LM's default is learned_absolute.
    ArgSpec(
        "position_embedding_type",
        "str",
        "learned_absolute",
        ("learned_absolute", "rope", "mrope", "none"),
    ),
    # GPTModel(rotary_base=...): RoPE theta.
    ArgSpec("rotary_base", "int", 10000),
    # GPTModel(rotary_percent=...): fraction of each head's dims that RoPE rotates.
    ArgSpec("rotary_percent", "float", 1.0),
    # TransformerConfig.layernorm_epsilon (LayerNorm and RMSNorm).
    ArgSpec("norm_epsilon", "float", 1e-5),
    # Training sequence length in tokens.
    ArgSpec("seq_length", "int", None, nullable=True),
    # GPTModel(max_sequence_length=...); falls back to seq_length when unset.
    ArgSpec("max_position_embeddings", "int", None, nullable=True),
    # Samples per micro-batch per data-parallel rank.
    ArgSpec("micro_batch_size", "int", None, nullable=True),
    # Samples per optimizer step over all data-parallel ranks.
    ArgSpec("global_batch_size", "int", None, nullable=True),
    # Optimizer steps to run.
    ArgSpec("train_iters", "int", None, nullable=True),
    # Learning-rate schedule after warm-up (Megatron-LM's OptimizerParamScheduler styles).
    ArgSpec(
        "lr_decay_style",
        "str",
        "linear",
        ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    ),
    # Linear warm-up steps from 0 to lr.
    ArgSpec("lr_warmup_iters", "int", 0),
    # Megatron's RNG seed (model init, dropout).
    ArgSpec("seed", "int", 1234),
    # Megatron checkpoint directory to load from.
    ArgSpec("load", "str", None, nullable=True),
    # Megatron checkpoint directory to save to.
    ArgSpec("save", "str", None, nullable=True),
    # Vocabulary size; None means "from the tokenizer / HF config".
    ArgSpec("vocab_size", "int", None, nullable=True),
    # Minutes a collective may wait before it fails (every process group; platform.timeout_s).
    ArgSpec("distributed_timeout_minutes", "int", None, nullable=True),
    # Pad the vocabulary to a multiple of this times the TP size, as Megatron-LM does.
    ArgSpec("make_vocab_size_divisible_by", "int", 128),
)

# Megatron-LM arguments applied by this package that are no dataclass field (or one the walk
# below skips); their type and default come from Megatron-LM's own flag (`inventory.inventory()`
# of the installed release; a dest that release lacks is left out). Who applies each:
APPLIED_HERE = {
    # roles/lr_schedule.py (megatron-core's OptimizerParamScheduler), in optimizer steps
    "schedule": (
        "lr_decay_iters", "lr_decay_samples", "lr_warmup_fraction", "lr_warmup_samples",
        "lr_warmup_init", "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
        "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
        "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
    ),
    # recipe/schema.py: collective_timeout_s, startup_timeout_s
    "timeouts": ("distributed_timeout_seconds_after_init",),
    # the run's length and exits: recipe/load.py (RL steps from optimizer steps),
    # checkpoint/manager.py (exits, saves), roles/learn.py (iterations to skip)
    "loop": (
        "iterations_to_skip", "train_samples", "exit_duration_in_mins", "exit_interval",
        "exit_signal_handler", "exit_signal", "save_interval",
    ),
    # roles/megatron_role.py: DDP buckets from a bucket count
    "ddp": ("ddp_num_buckets", "align_grad_reduce"),
    # roles/learn.py, around the train stage (memory_hygiene, check_replicas_agree)
    "memory": (
        "manual_gc", "manual_gc_interval", "manual_gc_eval", "empty_unused_memory_level",
        "train_sync_interval", "check_weight_hash_across_dp_replicas_interval",
    ),
    # transformer_config_kwargs: activations, init, lists, the attention backend enum
    "model": (
        "attention_backend", "window_size", "hierarchical_context_parallel_sizes",
        "recompute_modules", "mrope_section", "offload_modules", "squared_relu", "quick_geglu",
        "init_method_xavier_uniform", "add_position_embedding",
        "moe_layer_freq", "fp8_param_gather", "pipeline_model_parallel_layout",
        "flash_attention_version",  # from megatron-core 0.19: a Literal of ints
    ),
    # roles/megatron_role.py: log-probs in the logits' dtype, the JIT fuser off
    "role": ("fp16_lm_cross_entropy", "disable_jit_fuser"),
    # gpt_model_kwargs: GPTModel arguments
    "gpt": ("rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor"),
    # algorithms/batch_ramp.py: the G of each RL step (roles/learn.py, roles/critic.py)
    "batch": ("rampup_batch_size", "decrease_batch_size_if_needed"),
    # distributed/pg_options.py: options of each role's groups (distributed/groups.py)
    "groups": (
        "nccl_communicator_config_path", "high_priority_stream_groups", "use_sharp",
        "sharp_enabled_group",
    ),
    # distributed/layout.py: the rank order inside each Megatron role's window (its groups in
    # distributed/groups.py, the weight-sync senders in weight_sync/plan.py)
    "rank_order": ("use_tp_pp_dp_mapping",),
    # roles/param_groups.py: the train role's optimizer param groups, written after it is built
    "param_groups": ("dump_param_to_param_group_map",),
    # virtual (interleaved) pipeline stages: `virtual_stages` -> transformer_config_kwargs
    # (virtual_pipeline_model_parallel_size), models/builder.py (one GPTModel per model chunk),
    # models/dims.py (each chunk's layers), roles/megatron_role.py (the interleaved schedule)
    "virtual_pipeline": (
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    ),
    # models/upcycle.py: the MoE checkpoint made from model.hf_path's dense one, checked by
    # recipe/load.py (the MoE architecture every role builds), written by train.py at start
    "upcycling": ("moe_use_upcycling", "moe_upcycling_granularity"),
    # models/torch_fsdp2.py: the trained roles' model chunks in megatron-core's FSDP2 wrapper
    # instead of DDP (roles/megatron_role.py); full tensors of them for the HF load and export
    # (models/weights.py), weight sync (weight_sync/broadcast.py) and checkpoints
    # (checkpoint/megatron_state.py); Megatron-LM's rules for them in
    # `rules._torch_fsdp2_rules`
    "torch_fsdp2": ("use_torch_fsdp2", "torch_fsdp2_reshard_after_forward"),
}  # fmt: skip

_LIST_TYPES = {"int": "int_list", "str": "str_list"}


def _specs_from_megatron_lm(known: dict[str, ArgSpec]) -> list[ArgSpec]:
    """ArgSpecs of `APPLIED_HERE` from Megatron-LM's flags (type, default, choices)."""
    from megatron_async_rl.config.megatron import inventory

    rows = inventory.lm_dests()
    out = []
    for dest in (d for group in APPLIED_HERE.values() for d in group):
        if dest not in rows or (dest in known and dest != "moe_layer_freq"):
            continue  # moe_layer_freq: a dataclass int; Megatron-LM's takes lists
        row = rows[dest]
        if row.kind in ("true", "false", "bool_optional"):
            out.append(ArgSpec(dest, "bool", bool(row.default)))
            continue
        kind = (row.type or "str").removeprefix("other:")
        kind = kind if kind in ("int", "float", "str") else "str"
        if dest in ("window_size", "moe_layer_freq"):
            kind = "int"  # "(a, b)" / "[1]*3+[0]" expressions: parsed by _int_list_expr
        several = row.nargs in ("+", "*") or (isinstance(row.nargs, int) and row.nargs > 1)
        if several or dest in ("window_size", "moe_layer_freq"):
            kind = _LIST_TYPES[kind]
        choices = row.choices  # typed as Megatron-LM's (ints for --empty-unused-memory-level)
        out.append(ArgSpec(dest, kind, row.default, choices, True))
    return out


# Megatron-LM flags that write a dataclass field under a different (negated) name.
_MEGATRON_LM_FLAGS = (
    # store_false on TransformerConfig.add_bias_linear.
    FlagSpec("--disable-bias-linear", "add_bias_linear", False),
    # Megatron-LM turns these fusions on by default and offers only the negative; so do we
    # (`MEGATRON_LM_DEFAULTS`). The builder turns them off on CPU, and on a GPU without
    # Transformer Engine those that need its (or Apex's) kernels, saying so once.
    FlagSpec("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    FlagSpec("--no-bias-dropout-fusion", "bias_dropout_fusion", False),
    FlagSpec("--no-bias-gelu-fusion", "bias_activation_fusion", False),
    FlagSpec("--no-bias-swiglu-fusion", "bias_activation_fusion", False),
    FlagSpec("--no-rope-fusion", "apply_rope_fusion", False),
    FlagSpec("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    FlagSpec("--no-persist-layer-norm", "persist_layer_norm", False),
)


def _annotation_kind(annotation: Any) -> tuple[str, tuple[str, ...] | None, bool] | None:
    """(type, choices, nullable) for a supported annotation, else None."""
    if annotation in _SCALAR_TYPES:
        return _SCALAR_TYPES[annotation], None, False
    origin = typing.get_origin(annotation)
    members = typing.get_args(annotation)
    if origin is Literal and members and all(isinstance(m, str) for m in members):
        return "str", tuple(members), False
    if origin in (typing.Union, types.UnionType):
        # Optional[X], and "X or a list of X" (e.g. moe_aux_loss_coeff), which Megatron-LM's
        # flags take as a single X.
        rest = [m for m in members if m is not type(None)]
        lists = [m for m in rest if typing.get_origin(m) is list]
        scalars = [m for m in rest if m not in lists]
        inner = _annotation_kind(scalars[0]) if len(scalars) == 1 else None
        if inner is None or any(typing.get_args(m) != (scalars[0],) for m in lists):
            return None
        return inner[0], inner[1], type(None) in members
    return None


def _derive_specs() -> list[ArgSpec]:
    """Walk megatron-core's config dataclasses (imports megatron-core, ~5 s)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    specs: dict[str, ArgSpec] = {}
    configs = (
        TransformerConfig,
        MLATransformerConfig,
        OptimizerConfig,
        DistributedDataParallelConfig,
    )
    for cls in configs:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            name = field.name
            if name.startswith("_") or name in specs or name in RENAMED or not field.init:
                continue  # first class wins: fields shared by several configs are one flag
            kind = _annotation_kind(hints[name])
            if kind is None or field.default_factory is not dataclasses.MISSING:
                continue
            type_name, choices, nullable = kind
            default = None if field.default is dataclasses.MISSING else field.default
            if name in _UNSET_DEFAULTS:
                default = None
            if type_name == "float" and isinstance(default, int) and not isinstance(default, bool):
                default = float(default)
            specs[name] = ArgSpec(
                name, type_name, default, choices, nullable or default is None, cls.__name__
            )
    return list(specs.values())


def _cache_path() -> Path | None:
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    try:
        root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "megatron_async_rl"
    except RuntimeError:  # no home directory: run without the disk cache
        return None
    return Path(root) / f"megatron_flags-{version}-{digest}.json"


def _load_derived_specs() -> list[ArgSpec]:
    path = _cache_path()
    if path is not None and path.is_file():
        try:
            rows = json.loads(path.read_text())
            return [
                ArgSpec(**{**row, "choices": row["choices"] and tuple(row["choices"])})
                for row in rows
            ]
        except (OSError, ValueError, TypeError, KeyError) as err:
            logger.debug("ignoring unreadable flag cache %s: %s", path, err)
    specs = _derive_specs()
    if path is not None:
        try:  # write then rename: several ranks may race to fill the cache
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps([dataclasses.asdict(s) for s in specs]))
            os.replace(tmp, path)
        except OSError as err:
            logger.debug("cannot write flag cache %s: %s", path, err)
    return specs


def warm_flag_cache() -> Path | None:
    """Derive the flag table and write its disk cache (e.g. before launching many ranks)."""
    _load_derived_specs()
    path = _cache_path()
    return path if path is not None and path.is_file() else None


@functools.cache
def flag_table() -> tuple[dict[str, ArgSpec], dict[str, FlagSpec]]:
    """(dest -> ArgSpec, flag -> FlagSpec) for every known Megatron argument."""
    specs = {s.dest: s for s in _load_derived_specs()}
    specs.update({s.dest: s for s in _MEGATRON_LM_ARGS})
    specs.update({s.dest: s for s in _specs_from_megatron_lm(specs)})
    flags: dict[str, FlagSpec] = {}
    for spec in specs.values():
        stem = spec.dest.replace("_", "-")
        if spec.type != "bool":
            flags[f"--{stem}"] = FlagSpec(f"--{stem}", spec.dest)
        elif spec.default is True:
            flags[f"--no-{stem}"] = FlagSpec(f"--no-{stem}", spec.dest, False)
        else:
            flags[f"--{stem}"] = FlagSpec(f"--{stem}", spec.dest, True)
    flags.update({f.flag: f for f in _MEGATRON_LM_FLAGS})
    return specs, flags


MEGATRON_LM_DEFAULTS = {
    "masked_softmax_fusion": True,
    "bias_dropout_fusion": True,
    "bias_activation_fusion": True,
    "apply_rope_fusion": True,
    "gradient_accumulation_fusion": True,
    "persist_layer_norm": True,
    "overlap_p2p_comm": True,
}
"""Where Megatron-LM's default differs from megatron-core's dataclass (review finding 12: with
the dataclass's False, TE never fused wgrad into main_grad on GPUs). `overlap_p2p_comm`, as in
Megatron-LM, takes effect with virtual pipeline stages only (`transformer_config_kwargs`)."""


def defaults() -> dict[str, Any]:
    """The default of every known Megatron argument, keyed by dest (Megatron-LM's)."""
    out = {dest: spec.default for dest, spec in flag_table()[0].items()}
    out.update((k, v) for k, v in MEGATRON_LM_DEFAULTS.items() if k in out)
    return out


_INT_EXPR = re.compile(r"^[\s\d\[\]\(\),+*]+$")


def _int_list_expr(text: str, key: str) -> list[int] | int:
    """Megatron-LM's list expressions: `[0]+[1]*26`, `(0, 128)`, `1,2,3` or a single int."""
    if not _INT_EXPR.match(text):
        raise ConfigError(key, text, "expected an int, a list of ints or a list expression")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # digits, brackets, commas, + and * only
    except (SyntaxError, TypeError, ValueError):
        raise ConfigError(
            key, text, "expected an int or a list expression like [0]+[1]*3"
        ) from None
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ConfigError(key, text, "expected an int or a list of ints")


def _coerce_list(spec: ArgSpec, value: Any, key: str) -> Any:
    if isinstance(value, str):
        if spec.type == "int_list":
            return _int_list_expr(value, key)
        value = value.split(",") if "," in value else [value]
    if isinstance(value, int) and spec.type == "int_list" and not isinstance(value, bool):
        return value
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, value, f"expected a list ({spec.type.replace('_', ' ')})")
    scalar = ArgSpec(spec.dest, spec.type.removesuffix("_list"), None, spec.choices)
    return [coerce(scalar, item, key) for item in value]


def coerce(spec: ArgSpec, value: Any, key: str) -> Any:
    """Check and convert one value of `spec`; strings (CLI, or YAML's `1e-5`) are parsed."""
    expected = spec.type + (" or null" if spec.nullable else "")
    if value is None:
        if spec.nullable:
            return None
        raise ConfigError(key, value, f"must not be null (expected {spec.type})")
    if spec.type.endswith("_list"):
        return _coerce_list(spec, value, key)
    if spec.type == "bool":
        return require_bool(key, value)
    if isinstance(value, (bool, list, dict)):
        raise ConfigError(key, value, f"expected {expected}")
    try:
        if spec.type == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError  # 2.0 is accepted (HF configs store rope_theta as a float)
            converted: Any = int(value)
        elif spec.type == "float":
            converted = float(value)
        else:
            converted = str(value)
    except ValueError:
        raise ConfigError(key, value, f"expected {expected}") from None
    if spec.type == "float" and not math.isfinite(converted):
        raise ConfigError(key, value, "must be a finite number (nan and inf are refused)")
    if spec.choices is not None and converted not in spec.choices:
        raise ConfigError(key, value, f"must be one of {', '.join(spec.choices)}")
    check_range(spec.dest, converted, key)
    return converted


def with_defaults(args: dict[str, Any]) -> dict[str, Any]:
    """`args` over every flag's default."""
    return {**defaults(), **args}


# Single-value ranges, applied wherever a value enters (flags and every `megatron:` section).
_AT_LEAST_ONE = frozenset(
    ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels")
    + ("num_query_groups", "num_experts", "moe_router_topk", "moe_ffn_hidden_size")
    + ("micro_batch_size", "global_batch_size", "seq_length", "max_position_embeddings")
    + ("vocab_size", "make_vocab_size_divisible_by", "rotary_base", "train_iters")
    + ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
    + ("microbatch_group_size_per_vp_stage",)
)
_NON_NEGATIVE = frozenset(
    ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "clip_grad")
    + ("lr_warmup_iters",)
)
_POSITIVE = frozenset(["adam_eps", "norm_epsilon", "init_method_std"])
_PROBABILITY = frozenset(["hidden_dropout", "attention_dropout"])
_BETA = frozenset(["adam_beta1", "adam_beta2"])


def check_range(dest: str, value: Any, key: str) -> None:
    """Raise ConfigError (naming `key`) when a single value is out of its legal range."""
    if value is None or isinstance(value, (bool, str)):
        return
    if (dest in _AT_LEAST_ONE or dest.endswith("_parallel_size")) and value < 1:
        raise ConfigError(key, value, "must be >= 1")
    if dest in _NON_NEGATIVE and value < 0:
        raise ConfigError(key, value, "must be >= 0")
    if dest in _POSITIVE and value <= 0:
        raise ConfigError(key, value, "must be > 0")
    if dest == "rotary_percent" and not 0 < value <= 1:
        raise ConfigError(key, value, "must be in (0, 1]")
    if dest in _PROBABILITY and not 0 <= value <= 1:
        raise ConfigError(key, value, "must be in [0, 1]")
    if dest in _BETA and not 0 <= value < 1:
        raise ConfigError(key, value, "must be in [0, 1)")
