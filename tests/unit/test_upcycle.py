"""MoE upcycling of a dense checkpoint (`models/upcycle.py`): the tensors, the config, the plan.

Contract: (1) `upcycle_state_dict` turns each dense MLP into experts holding its G slices along
the FFN dimension (expert e: slice e % G, down_proj times G) and a router whose rows are tied in
copies of G; other tensors pass through; the router rows are the same however the layers are
batched. (2) For granularity 1, 2 and 3 the upcycled layer, run by `transformers`' own
`Qwen3MoeSparseMoeBlock` (softmax, top-k, renormalised), gives the dense `Qwen3MoeMLP`'s output
on random inputs within fp32 rounding; untying the router rows breaks it at G = 2 (the test
can fail). (3) `upcycled_hf_config` is a qwen3_moe config whose Megatron architecture is the
dense one plus the plan's MoE args. (4) `plan_upcycling` refuses every bad combination with a
ConfigError naming the flag, the value and the rule, and ignores a granularity without the flag
with a warning. Nothing is faked: tensors are random, the reference is `transformers`.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron import table
from megatron_async_rl.models import hf_config
from megatron_async_rl.models.upcycle import (
    UpcyclePlan,
    plan_upcycling,
    upcycle_state_dict,
    upcycled_hf_config,
)
from tests.harness.hf_configs import QWEN3

HIDDEN, FFN = 16, 24
PREFIX = "model.layers.{}.mlp."


def _dense_sd(num_layers: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(8, HIDDEN, generator=generator)}
    for layer in range(num_layers):
        p = PREFIX.format(layer)
        sd[p + "gate_proj.weight"] = torch.randn(FFN, HIDDEN, generator=generator) * 0.3
        sd[p + "up_proj.weight"] = torch.randn(FFN, HIDDEN, generator=generator) * 0.3
        sd[p + "down_proj.weight"] = torch.randn(HIDDEN, FFN, generator=generator) * 0.3
        sd[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.rand(HIDDEN) + 0.5
    return sd


PLANS = [UpcyclePlan(4, 2, 1, FFN), UpcyclePlan(4, 2, 2, FFN // 2), UpcyclePlan(6, 3, 3, FFN // 3)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"E{p.num_experts}k{p.topk}G{p.granularity}")
def test_experts_hold_the_dense_slices_and_the_router_is_tied(plan):
    dense = _dense_sd()
    moe = upcycle_state_dict(dense, plan, init_std=0.1, seed=7)
    g, width = plan.granularity, FFN // plan.granularity
    for layer in range(2):
        p = PREFIX.format(layer)
        assert not any(k.startswith(p) and "_proj" in k and "experts" not in k for k in moe)
        for e in range(plan.num_experts):
            part = slice((e % g) * width, (e % g + 1) * width)
            expert = f"{p}experts.{e}."
            assert torch.equal(
                moe[expert + "gate_proj.weight"], dense[p + "gate_proj.weight"][part]
            )
            assert torch.equal(moe[expert + "up_proj.weight"], dense[p + "up_proj.weight"][part])
            assert torch.equal(
                moe[expert + "down_proj.weight"], dense[p + "down_proj.weight"][:, part] * g
            )
        router = moe[p + "gate.weight"]
        assert router.shape == (plan.num_experts, HIDDEN)
        rows = router.view(plan.num_experts // g, g, HIDDEN)
        assert torch.equal(rows, rows[:, :1].expand_as(rows))  # tied within a copy
        assert len({tuple(r.tolist()) for r in rows[:, 0]}) == plan.num_experts // g
        assert 0.05 < router.std().item() < 0.2  # N(0, 0.1^2)
    for name in ("model.embed_tokens.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(moe[name], dense[name])
    layer1 = {k: v for k, v in dense.items() if k.startswith("model.layers.1.")}
    alone = upcycle_state_dict(layer1, plan, init_std=0.1, seed=7)
    assert torch.equal(
        alone[PREFIX.format(1) + "gate.weight"], moe[PREFIX.format(1) + "gate.weight"]
    )


def _moe_block(moe: dict, plan: UpcyclePlan):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeMLP,
        Qwen3MoeSparseMoeBlock,
    )

    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN // plan.granularity,
        num_experts=plan.num_experts, num_experts_per_tok=plan.topk, norm_topk_prob=True,
        experts_implementation="eager",
    )  # fmt: skip
    block, dense = Qwen3MoeSparseMoeBlock(config), Qwen3MoeMLP(config)
    p = PREFIX.format(0)
    experts = [f"{p}experts.{e}." for e in range(plan.num_experts)]
    with torch.no_grad():
        block.gate.weight.copy_(moe[p + "gate.weight"])
        block.experts.gate_up_proj.copy_(torch.stack([
            torch.cat([moe[x + "gate_proj.weight"], moe[x + "up_proj.weight"]]) for x in experts
        ]))  # fmt: skip
        block.experts.down_proj.copy_(torch.stack([moe[x + "down_proj.weight"] for x in experts]))
    return block, dense


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"E{p.num_experts}k{p.topk}G{p.granularity}")
def test_the_moe_layer_computes_the_dense_mlp(plan):
    dense_sd = _dense_sd(num_layers=1)
    moe = upcycle_state_dict(dense_sd, plan, init_std=0.1, seed=7)
    block, dense = _moe_block(moe, plan)
    p = PREFIX.format(0)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dense, name).weight.copy_(dense_sd[p + name + ".weight"])
        x = torch.randn(3, 40, HIDDEN, generator=torch.Generator().manual_seed(1))
        want, got = dense(x), block(x)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_untied_router_rows_break_the_equality():
    plan = PLANS[1]  # G = 2: a token must reach both slices of a copy
    moe = upcycle_state_dict(_dense_sd(num_layers=1), plan, init_std=0.1, seed=7)
    key = PREFIX.format(0) + "gate.weight"
    moe[key] = moe[key] + torch.randn(moe[key].shape, generator=torch.Generator().manual_seed(2))
    block, dense = _moe_block(moe, plan)
    p = PREFIX.format(0)
    dense_sd = _dense_sd(num_layers=1)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dense, name).weight.copy_(dense_sd[p + name + ".weight"])
        x = torch.randn(3, 40, HIDDEN, generator=torch.Generator().manual_seed(1))
        assert (block(x) - dense(x)).abs().max() > 1e-2


@pytest.mark.parametrize("granularity", [1, 2])
def test_the_config_is_the_dense_architecture_with_experts(granularity):
    plan = UpcyclePlan(4, 2, granularity, 128 // granularity)
    config = upcycled_hf_config(QWEN3, plan)
    assert config["model_type"] == "qwen3_moe"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["moe_intermediate_size"] == 128 // granularity
    assert config["norm_topk_prob"] is True and config["mlp_only_layers"] == []
    assert (config["eos_token_id"], config["torch_dtype"]) == (2, "float32")
    dense_args = hf_config.megatron_args_from_hf(QWEN3)
    assert hf_config.megatron_args_from_hf(config) == {**dense_args, **plan.moe_args()}


def _args(**given) -> dict:
    dense = hf_config.megatron_args_from_hf(QWEN3)
    return {**table.defaults(), **dense, "moe_use_upcycling": True, **given}


def test_the_plan_of_good_flags():
    assert plan_upcycling(_args(num_experts=8), QWEN3, "train") == UpcyclePlan(8, 2, 1, 128)
    assert plan_upcycling(
        _args(num_experts=8, moe_router_topk=4, moe_upcycling_granularity=4), QWEN3, "train"
    ) == UpcyclePlan(8, 4, 4, 32)  # fmt: skip
    explicit = _args(num_experts=4, moe_upcycling_granularity=2, moe_ffn_hidden_size=64)
    assert plan_upcycling(explicit, QWEN3, "ref") == UpcyclePlan(4, 2, 2, 64)


def test_granularity_without_the_flag_is_ignored_with_a_warning(caplog):
    args = {**_args(num_experts=None), "moe_use_upcycling": False, "moe_upcycling_granularity": 3}
    with caplog.at_level(logging.WARNING):
        assert plan_upcycling(args, QWEN3, "logp") is None
    assert "--moe-upcycling-granularity 3 is ignored without --moe-use-upcycling" in caplog.text


LLAMA = {**QWEN3, "model_type": "llama"}
QWEN3_MOE = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}  # fmt: skip


@pytest.mark.parametrize(
    ("dense", "given", "match"),
    [
        (LLAMA, {"num_experts": 4}, r"--moe-use-upcycling = True: model.hf_path's model_type "
         r"'llama' has no supported MoE twin: .*qwen3 -> qwen3_moe"),
        (QWEN3_MOE, {"num_experts": 4}, r"--moe-use-upcycling = True: model.hf_path is already "
         r"an MoE model \(model_type 'qwen3_moe'\)"),
        (QWEN3, {}, r"--num-experts = None: --moe-use-upcycling needs the number of experts"),
        (QWEN3, {"num_experts": 4, "moe_upcycling_granularity": 0},
         r"--moe-upcycling-granularity = 0: must be >= 1"),
        (QWEN3, {"num_experts": 6, "moe_router_topk": 4, "moe_upcycling_granularity": 4},
         r"--num-experts = 6: must be a multiple of --moe-upcycling-granularity = 4"),
        (QWEN3, {"num_experts": 8, "moe_router_topk": 3, "moe_upcycling_granularity": 2},
         r"--moe-router-topk = 3: must be a multiple of --moe-upcycling-granularity = 2"),
        (QWEN3, {"num_experts": 8, "moe_router_topk": 1},
         r"--moe-router-topk = 1: must be >= 2 for upcycling"),
        (QWEN3, {"num_experts": 8, "moe_router_pre_softmax": True},
         r"--moe-router-pre-softmax = True: cannot be combined with --moe-use-upcycling: the "
         r"top-k weights would not sum to 1"),
        (QWEN3, {"num_experts": 8, "moe_router_score_function": "sigmoid"},
         r"--moe-router-score-function = 'sigmoid': cannot be combined"),
        (QWEN3, {"num_experts": 8, "moe_layer_freq": [1, 0]},
         r"--moe-layer-freq = \[1, 0\]: --moe-use-upcycling makes every layer MoE"),
        (QWEN3, {"num_experts": 8, "load": "/ckpt/dense"},
         r"--load = '/ckpt/dense': --moe-use-upcycling upcycles model.hf_path"),
        (QWEN3, {"num_experts": 8, "ffn_hidden_size": 64, "moe_upcycling_granularity": 2},
         r"--ffn-hidden-size = 64: with --moe-use-upcycling the dense FFN size is "
         r"model.hf_path's \(128\)"),
        (QWEN3, {"num_experts": 6, "moe_router_topk": 3, "moe_upcycling_granularity": 3},
         r"--moe-upcycling-granularity = 3: must divide the dense FFN size 128"),
        (QWEN3, {"num_experts": 4, "moe_upcycling_granularity": 2, "moe_ffn_hidden_size": 128},
         r"--moe-ffn-hidden-size = 128: must be the dense FFN size / "
         r"--moe-upcycling-granularity = 128 / 2 = 64"),
    ],
    ids=["llama", "already-moe", "no-experts", "granularity-0", "experts%G", "topk%G", "top1",
         "pre-softmax", "sigmoid", "layer-freq", "load", "ffn-hidden-size", "ffn%G",
         "moe-ffn-hidden-size"],
)  # fmt: skip
def test_bad_combinations_are_refused(dense, given, match):
    with pytest.raises(ConfigError, match=match):
        plan_upcycling(_args(**given), dense, "train")
