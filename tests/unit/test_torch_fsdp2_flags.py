"""--use-torch-fsdp2 and --torch-fsdp2-no-reshard-after-forward: applied, and their rules.

Contract: both flags parse to their dests and are classified applied; every rule of
Megatron-LM's for --use-torch-fsdp2, and each combination not verified here, is a ConfigError
naming the flag, its value and a fix; the flag is ignored, with a warning, for a forward-only
role, and the reshard flag without it. `models.torch_fsdp2` refuses a model of mixed parameter
dtypes before wrapping it, and a checkpoint of shards that are not even (the FSDP2 parameter is
a stand-in there: a real one needs a process group of a size that does not divide dim 0).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError, warn_once
from megatron_async_rl.config.megatron import inventory as ml
from megatron_async_rl.config.megatron import parse as mp
from megatron_async_rl.config.megatron import rules
from megatron_async_rl.config.megatron import table as mf

FLAGS = ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"]


def _args(**extra):
    base = dict(mf.defaults(), num_layers=2, hidden_size=64, num_attention_heads=4, lr=1e-5)
    base.update(untie_embeddings_and_output_weights=True, gradient_accumulation_fusion=False)
    return {**base, **mp.parse_megatron_flags(FLAGS), **extra}


def test_flags_are_applied():
    assert mp.parse_megatron_flags(FLAGS) == {
        "use_torch_fsdp2": True, "torch_fsdp2_reshard_after_forward": False,
    }  # fmt: skip
    applied = frozenset(mf.flag_table()[0])
    for dest in ("use_torch_fsdp2", "torch_fsdp2_reshard_after_forward"):
        assert ml.classify(dest, applied) == ml.Verdict("applied"), dest
    rules.check_args(_args(), "train")
    untied = _args(untie_embeddings_and_output_weights=False)
    rules.check_args(untied, "critic")  # a head: untied


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"pipeline_model_parallel_size": 2}, r"--pipeline-model-parallel-size = 2: is not "
         r"supported with --use-torch-fsdp2 \(Megatron-LM's rule\).*hint: use 1"),
        ({"expert_model_parallel_size": 2, "num_experts": 4},
         r"--expert-model-parallel-size = 2: is not supported"),
        ({"use_distributed_optimizer": True}, r"--use-distributed-optimizer = True: .*FSDP2 "
         r"shards the optimizer state itself.*hint: drop it"),
        ({"gradient_accumulation_fusion": True}, r"--gradient-accumulation-fusion = True: .*"
         r"hint: add --no-gradient-accumulation-fusion"),
        ({"fp16": True}, r"--fp16 = True: is not supported.*hint: use --bf16"),
        ({"untie_embeddings_and_output_weights": False}, r"--untie-embeddings-and-output-"
         r"weights = False: --use-torch-fsdp2 needs untied embeddings.*hint: drop"),
        ({"tensor_model_parallel_size": 2}, r"--tensor-model-parallel-size = 2: .*wrong "
         r"offsets.*hint: use 1, or drop --use-torch-fsdp2"),
        ({"context_parallel_size": 2}, r"--context-parallel-size = 2: .*not verified"),
        ({"num_experts": 4}, r"--num-experts = 4: .*MoE under FSDP2 is not verified"),
        ({"check_weight_hash_across_dp_replicas_interval": 5},
         r"--check-weight-hash-across-dp-replicas-interval = 5: .*no replicas to compare"),
    ],
)  # fmt: skip
def test_rules_are_config_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        rules.check_args(_args(**extra), "train")


def test_ignored_where_nothing_is_wrapped(caplog):
    caplog.set_level(logging.WARNING)
    warn_once.cache_clear()
    forward_only = _args(pipeline_model_parallel_size=2)
    rules.check_args(forward_only, "logp")  # forward-only: no rule
    no_fsdp2 = _args(use_torch_fsdp2=False)
    rules.check_args(no_fsdp2, "train")
    messages = [r.getMessage() for r in caplog.records]
    assert "--use-torch-fsdp2 is ignored for the forward-only role logp" in messages[0]
    assert (
        "--torch-fsdp2-no-reshard-after-forward is ignored without --use-torch-fsdp2"
        in (messages[1])
    )


def test_mixed_parameter_dtypes_are_refused():
    from megatron_async_rl.models import torch_fsdp2

    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2).bfloat16(), torch.nn.LayerNorm(2))
    with pytest.raises(ValueError, match=r"mixes torch.bfloat16 \(0.weight\), torch.float32 "
                       r"\(1.weight\).*drop --bf16, or --use-torch-fsdp2"):  # fmt: skip
        torch_fsdp2.wrap_chunks([chunk], None, {}, False, None)


def test_uneven_shards_are_refused_before_a_checkpoint(monkeypatch):
    from megatron_async_rl.models import torch_fsdp2

    param = SimpleNamespace(shape=(64, 8), device_mesh=SimpleNamespace(size=lambda: 3))
    chunk = SimpleNamespace(named_parameters=lambda: [("decoder.final_layernorm.weight", param)])
    monkeypatch.setattr(torch_fsdp2, "is_sharded", lambda tensor: True)
    with pytest.raises(
        ValueError,
        match=r"role train's parameter decoder.final_layernorm.weight "
        r"\(dim 0 of size 64\) does not split evenly over its 3 data-parallel",
    ):
        torch_fsdp2.check_even_shards([chunk], "train")
