"""Megatron-LM-style flags derived from megatron-core's config dataclasses (`config/megatron/`).

Contract: every int/float/str/bool (Optional or Literal-of-str) field of TransformerConfig
(with ModelParallelConfig), OptimizerConfig and DistributedDataParallelConfig is a flag
`--field-name` with the field's type and default (the field list is walked here independently);
Megatron-LM's own names come from a documented alias table; bools defaulting to False are bare
`store_true` flags, those defaulting to True get `--no-*`. `parse_megatron_flags` and
`normalize_megatron_section` type values the same way; the `*_kwargs` helpers build real
megatron-core configs with the aliases translated. The derived table survives its disk cache.
Nothing is faked (megatron-core is imported).
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron import core_kwargs, rules
from megatron_async_rl.config.megatron import parse as mp
from megatron_async_rl.config.megatron import table as mf

# Flag -> (dest, bare-flag value or None, type, default), as Megatron-LM's argparse defines them
# (defaults from megatron-core where the field is derived).
MEGATRON_LM_FLAGS = {
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", None, "int", 1),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", None, "int", 1),
    "--expert-model-parallel-size": ("expert_model_parallel_size", None, "int", 1),
    "--sequence-parallel": ("sequence_parallel", True, "bool", False),
    "--num-layers": ("num_layers", None, "int", None),
    "--hidden-size": ("hidden_size", None, "int", None),
    "--ffn-hidden-size": ("ffn_hidden_size", None, "int", None),
    "--num-attention-heads": ("num_attention_heads", None, "int", None),
    "--num-query-groups": ("num_query_groups", None, "int", None),
    "--normalization": ("normalization", None, "str", "LayerNorm"),
    "--moe-router-topk": ("moe_router_topk", None, "int", 2),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", None, "int", None),
    "--qk-layernorm": ("qk_layernorm", True, "bool", False),
    "--add-qkv-bias": ("add_qkv_bias", True, "bool", False),
    "--kv-channels": ("kv_channels", None, "int", None),
    "--lr": ("lr", None, "float", None),
    "--min-lr": ("min_lr", None, "float", None),
    "--weight-decay": ("weight_decay", None, "float", 0.01),
    "--clip-grad": ("clip_grad", None, "float", 1.0),
    "--adam-beta1": ("adam_beta1", None, "float", 0.9),
    "--adam-beta2": ("adam_beta2", None, "float", 0.999),
    "--adam-eps": ("adam_eps", None, "float", 1e-8),
    "--init-method-std": ("init_method_std", None, "float", 0.02),
    "--attention-dropout": ("attention_dropout", None, "float", 0.1),
    "--hidden-dropout": ("hidden_dropout", None, "float", 0.1),
    "--overlap-grad-reduce": ("overlap_grad_reduce", True, "bool", False),
    "--swiglu": ("swiglu", True, "bool", False),
    "--group-query-attention": ("group_query_attention", True, "bool", False),
    "--disable-bias-linear": ("add_bias_linear", False, "bool", True),
    "--num-experts": ("num_experts", None, "int", None),
    "--untie-embeddings-and-output-weights": (
        "untie_embeddings_and_output_weights",
        True,
        "bool",
        False,
    ),
    "--position-embedding-type": ("position_embedding_type", None, "str", "learned_absolute"),
    "--rotary-base": ("rotary_base", None, "int", 10000),
    "--norm-epsilon": ("norm_epsilon", None, "float", 1e-5),
    "--seq-length": ("seq_length", None, "int", None),
    "--max-position-embeddings": ("max_position_embeddings", None, "int", None),
    "--micro-batch-size": ("micro_batch_size", None, "int", None),
    "--global-batch-size": ("global_batch_size", None, "int", None),
    "--train-iters": ("train_iters", None, "int", None),
    "--lr-decay-style": ("lr_decay_style", None, "str", "linear"),
    "--lr-warmup-iters": ("lr_warmup_iters", None, "int", 0),
    "--seed": ("seed", None, "int", 1234),
    "--load": ("load", None, "str", None),
    "--save": ("save", None, "str", None),
    "--vocab-size": ("vocab_size", None, "int", None),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", None, "int", 128),
    "--use-distributed-optimizer": ("use_distributed_optimizer", True, "bool", False),
    "--bf16": ("bf16", True, "bool", False),
    "--fp16": ("fp16", True, "bool", False),
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", False, "bool", False),
    "--no-async-tensor-model-parallel-allreduce": (
        "async_tensor_model_parallel_allreduce",
        False,
        "bool",
        True,
    ),
}


_REMOVED_BY_RELEASE = {"--no-async-tensor-model-parallel-allreduce": "0.17"}
"""Flags whose config field megatron-core dropped, and the first release without it."""


@pytest.mark.parametrize("flag", sorted(MEGATRON_LM_FLAGS))
def test_megatron_lm_flag(flag):
    from packaging.version import Version

    from megatron_async_rl.compat.versions import installed_version

    gone = _REMOVED_BY_RELEASE.get(flag)
    if gone and Version(installed_version("megatron-core")) >= Version(gone):
        pytest.skip(f"megatron-core {gone} and later have no field for {flag}")
    specs, flags = mf.flag_table()
    dest, const, type_name, default = MEGATRON_LM_FLAGS[flag]
    assert flags[flag].dest == dest and flags[flag].const == const
    assert specs[dest].type == type_name and specs[dest].default == default


def _scalar_fields():
    """Fields a flag must exist for, found without the flag table's own walker."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    ok = {int, float, str, bool, typing.Optional[int], typing.Optional[float], typing.Optional[str]}
    for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name.startswith("_") or field.default_factory is not dataclasses.MISSING:
                continue
            if hints[field.name] in ok:
                yield cls, field, hints[field.name]


def test_every_scalar_dataclass_field_is_a_flag():
    specs, flags = mf.flag_table()
    seen = 0
    for _cls, field, hint in _scalar_fields():
        if field.name in mf.RENAMED:
            assert mf.RENAMED[field.name] in specs
            continue
        spec = specs[field.name]
        seen += 1
        base = typing.get_args(hint)[0] if typing.get_args(hint) else hint
        assert spec.type == base.__name__, field.name
        if spec.type == "bool":
            negative = "--no-" if spec.default is True else "--"
            assert f"{negative}{field.name.replace('_', '-')}" in flags
        else:
            assert f"--{field.name.replace('_', '-')}" in flags
    assert seen > 200
    assert "activation_func" not in specs and "params_dtype" not in specs  # callables, dtypes


def test_literal_fields_carry_choices():
    specs = mf.flag_table()[0]
    assert specs["normalization"].choices == ("LayerNorm", "RMSNorm")
    assert specs["recompute_granularity"].choices == ("full", "selective")
    assert specs["recompute_granularity"].nullable


def test_parse_forms():
    parsed = mp.parse_megatron_flags(
        [
            "--tensor-model-parallel-size",
            "2",
            "--lr=1e-6",
            "--sequence-parallel",
            "--disable-bias-linear",
            "--normalization",
            "RMSNorm",
            "--glu-linear-offset",
            "-1.5",
            "--no-masked-softmax-fusion",
            "--lr",
            "2e-6",
        ]
    )
    assert parsed == {
        "tensor_model_parallel_size": 2,
        "lr": 2e-6,  # the last occurrence wins, as in argparse
        "sequence_parallel": True,
        "add_bias_linear": False,
        "normalization": "RMSNorm",
        "glu_linear_offset": -1.5,  # a negative number is a value, not a flag
        "masked_softmax_fusion": False,
    }
    assert mp.parse_megatron_flags([]) == {}


def test_adam_eps_sign_is_still_checked_in_sections():
    with pytest.raises(ConfigError, match=r"megatron.adam_eps = -1e-08: must be > 0"):
        mp.normalize_megatron_section({"adam_eps": -1e-8}, "megatron")


def test_normalize_section_key_forms():
    section = {
        "tensor-model-parallel-size": 2,
        "lr": "1e-5",  # PyYAML reads 1e-5 (no dot) as a string
        "disable_bias_linear": True,
        "no_gradient_accumulation_fusion": True,
        "no_bf16": True,
        "rotary_base": 1000000.0,  # HF configs store rope_theta as a float
        "load": None,
    }
    assert mp.normalize_megatron_section(section, "megatron") == {
        "tensor_model_parallel_size": 2,
        "lr": 1e-5,
        "add_bias_linear": False,
        "gradient_accumulation_fusion": False,
        "bf16": False,
        "rotary_base": 1000000,
        "load": None,
    }
    normalized = mp.normalize_megatron_section(section, "megatron")
    assert mp.normalize_megatron_section(normalized, "megatron") == normalized  # idempotent
    assert mp.normalize_megatron_section(None, "megatron") == {}


def test_normalize_section_errors():
    with pytest.raises(ConfigError, match=r"m.add_bias_linear = False: sets add_bias_linear again"):
        mp.normalize_megatron_section({"disable_bias_linear": True, "add_bias_linear": False}, "m")
    with pytest.raises(ConfigError, match=r"m.bf16 = 'yes': must be true or false"):
        mp.normalize_megatron_section({"bf16": "yes"}, "m")
    with pytest.raises(ConfigError, match=r"m.num_layers = 2.5: expected int or null"):
        mp.normalize_megatron_section({"num_layers": 2.5}, "m")
    with pytest.raises(ConfigError, match=r"m.seed = None: must not be null \(expected int\)"):
        mp.normalize_megatron_section({"seed": None}, "m")
    with pytest.raises(ConfigError, match=r"m = \[1\]: must be a mapping"):
        mp.normalize_megatron_section([1], "m")


def test_defaults():
    d = mf.defaults()
    assert d["tensor_model_parallel_size"] == 1 and d["lr"] is None and d["swiglu"] is False
    d["lr"] = 5.0
    assert mf.defaults()["lr"] is None  # a fresh dict each call


def test_transformer_config_from_kwargs():
    from megatron.core.transformer import TransformerConfig

    args = {
        **mp.parse_megatron_flags(
            [
                "--num-layers",
                "2",
                "--hidden-size",
                "64",
                "--num-attention-heads",
                "4",
                "--swiglu",
                "--norm-epsilon",
                "1e-6",
                "--num-query-groups",
                "2",
                "--bf16",
            ]
        ),
    }
    kwargs = core_kwargs.transformer_config_kwargs(args)
    assert kwargs["num_query_groups"] is None  # no --group-query-attention: Megatron-LM ignores it
    fusions = [k for k in mf.MEGATRON_LM_DEFAULTS if k != "overlap_p2p_comm"]
    assert all(kwargs[k] for k in fusions)  # Megatron-LM's fusions on
    assert not kwargs["overlap_p2p_comm"]  # Megatron-LM's default, off without virtual stages
    kwargs.update(dict.fromkeys(mf.MEGATRON_LM_DEFAULTS, False))  # as the builder does on CPU
    config = TransformerConfig(**kwargs)
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert config.layernorm_epsilon == 1e-6
    assert config.params_dtype is torch.bfloat16 and config.num_query_groups == 4
    gqa = TransformerConfig(
        **{
            **kwargs,
            **core_kwargs.transformer_config_kwargs({**args, "group_query_attention": True}),
            **dict.fromkeys(mf.MEGATRON_LM_DEFAULTS, False),
        }
    )
    assert gqa.num_query_groups == 2
    moe = core_kwargs.transformer_config_kwargs({**args, "num_experts": 4})
    assert moe["num_moe_experts"] == 4 and "num_experts" not in moe


def test_optimizer_ddp_and_gpt_kwargs():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    args = mp.parse_megatron_flags(
        [
            "--lr",
            "1e-5",
            "--min-lr",
            "1e-6",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--seq-length",
            "64",
            "--untie-embeddings-and-output-weights",
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "500000",
        ]
    )
    opt = OptimizerConfig(**core_kwargs.optimizer_config_kwargs(args))
    assert (opt.lr, opt.min_lr, opt.use_distributed_optimizer) == (1e-5, 1e-6, True)
    ddp = DistributedDataParallelConfig(**core_kwargs.ddp_config_kwargs(args))
    assert ddp.overlap_grad_reduce and ddp.use_distributed_optimizer
    assert core_kwargs.gpt_model_kwargs(args) == {
        "position_embedding_type": "rope",
        "rotary_base": 500000,
        "rotary_percent": 1.0,
        "share_embeddings_and_output_weights": False,
        "max_sequence_length": 64,
        "rope_scaling": False,
        "rope_scaling_factor": 8.0,
        "seq_len_interpolation_factor": None,
        "vocab_size": None,
    }
    assert (
        core_kwargs.gpt_model_kwargs({"max_position_embeddings": 128, "seq_length": 64})[
            "max_sequence_length"
        ]
        == 128
    )


ARCH = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "lr": 1e-5}


def test_check_args_accepts_a_valid_moe_model():
    rules.check_args(
        {
            "num_layers": 2,
            "lr": 1e-5,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_experts": 4,
            "moe_router_topk": 2,
            "expert_model_parallel_size": 2,
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
            "group_query_attention": True,
            "num_query_groups": 2,
        },
        "train",
    )
    with pytest.raises(ConfigError, match=r"--sequence-parallel = False: MoE with"):
        rules.check_args(
            {**ARCH, "num_experts": 4, "tensor_model_parallel_size": 2}, "train"
        )
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size = 2: needs --num-experts"):
        rules.check_args({**ARCH, "expert_model_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"--min-lr = 0.1: must be <= --lr = 0.01"):
        rules.check_args({**ARCH, "lr": 0.01, "min_lr": 0.1})


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(mf.CACHE_DIR_ENV, str(tmp_path))
    path = mf.warm_flag_cache()
    assert path is not None and path.parent == tmp_path
    assert mf._load_derived_specs() == mf._derive_specs()  # read back from the file
    path.write_text("not json")
    assert mf._load_derived_specs() == mf._derive_specs()  # a bad cache is rebuilt


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_builder_keeps_megatron_lm_fusions_where_their_kernels_exist(device, caplog):
    """On CPU every fusion is off; on a GPU without Transformer Engine (this machine has none:
    the config is built, not run) those needing TE's kernels are off, with one warning, and the
    pure-PyTorch ones (bias + activation, bias + dropout) stay on, as in Megatron-LM."""
    from megatron_async_rl.distributed.layout import Parallelism
    from megatron_async_rl.distributed.platform import Platform
    from megatron_async_rl.models import builder

    args = {**mf.defaults(), "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "swiglu": True}  # fmt: skip
    config = builder.build_transformer_config(args, Parallelism(1, 1), Platform(device, "gloo"))
    te_fused = ("gradient_accumulation_fusion", "apply_rope_fusion", "persist_layer_norm",
                "masked_softmax_fusion")  # fmt: skip
    assert not any(getattr(config, k) for k in te_fused)
    assert config.bias_activation_fusion == config.bias_dropout_fusion == (device == "cuda")
    warned = [
        r.message for r in caplog.records if "Transformer Engine is not importable" in r.message
    ]
    assert len(warned) == (device == "cuda")
    args["bias_dropout_fusion"] = False  # --no-bias-dropout-fusion is kept
    config = builder.build_transformer_config(args, Parallelism(1, 1), Platform(device, "gloo"))
    assert not config.bias_dropout_fusion
