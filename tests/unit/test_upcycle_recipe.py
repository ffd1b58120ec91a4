"""Megatron-LM's `--moe-use-upcycling` and `--moe-upcycling-granularity` in a recipe.

Contract: with a dense qwen3 `model.hf_path`, the flags (after `--` or in `megatron:`) resolve
every role that loads model.hf_path to the architecture of the upcycled qwen3_moe model (the
dense one plus `--num-experts`, `--moe-router-topk`, expert FFN = dense FFN / granularity), the
resolved config reads back equal, and `--dry-run` accepts them; a bad combination exits 2 with
one `error:` line naming the flag, the value and the rule; roles that would load different MoE
models, a role with its own checkpoint asking for it and a recipe without model.hf_path are
refused. Faked: the HF directory is a hand-written qwen3 `config.json` plus an empty
`model.safetensors` (resolving reads only the config).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.models import upcycle
from megatron_async_rl.recipe.load import build_config, resolve
from megatron_async_rl.recipe.tree import load_recipe, write_resolved
from tests.harness.hf_configs import QWEN3

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = """\
run_dir: {run_dir}
model: {{hf_path: {model}}}
trainer: {{job: role_check}}
roles:
  groups: [{{roles: [train, logp, ref], num_ranks: 1}}]
megatron: {{bf16: false, lr: 1.0e-5, micro_batch_size: 2, seq_length: 64,
           transformer_impl: local}}
"""


@pytest.fixture
def recipe(tmp_path) -> Path:
    model = tmp_path / "qwen3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3))
    (model / "model.safetensors").write_bytes(b"")
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(run_dir=tmp_path / "run", model=model))
    return path


def test_good_flags_resolve_every_role_to_the_upcycled_moe(recipe, tmp_path):
    flags = ["--moe-use-upcycling", "--num-experts", "4", "--moe-upcycling-granularity", "2"]
    cfg = resolve(recipe, [], flags)
    for role in ("train", "logp", "ref"):
        args = cfg.role_megatron_args[role]
        assert (args["num_experts"], args["moe_router_topk"]) == (4, 2), role
        assert (args["ffn_hidden_size"], args["moe_ffn_hidden_size"]) == (128, 64), role
        assert args["moe_use_upcycling"] and args["moe_upcycling_granularity"] == 2
        assert args["moe_router_pre_softmax"] is False and args["moe_layer_freq"] == 1
    assert upcycle.plan_of(cfg.role_megatron_args) == upcycle.UpcyclePlan(4, 2, 2, 64)
    assert cfg.model.hf_path == str(tmp_path / "qwen3")  # the run points at the MoE at start
    again = build_config(load_recipe(write_resolved(cfg, tmp_path / "resolved.yaml")), [])
    assert again.role_megatron_args == cfg.role_megatron_args


def test_flags_in_the_recipe_resolve_alike(recipe):
    text = recipe.read_text().replace("seq_length: 64,", "seq_length: 64, moe_use_upcycling: "
                                      "true, num_experts: 8, moe_router_topk: 4,")  # fmt: skip
    recipe.write_text(text)
    cfg = resolve(recipe, [], [])
    assert upcycle.plan_of(cfg.role_megatron_args) == upcycle.UpcyclePlan(8, 4, 1, 128)


def _dry_run(recipe: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_async_rl.train", "--config", str(recipe),
           "--dry-run", "--world-size", "1", "--", *flags]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_dry_run_accepts_good_flags_and_refuses_a_bad_one_in_one_line(recipe):
    good = _dry_run(recipe, "--moe-use-upcycling", "--num-experts", "4")
    assert good.returncode == 0, good.stderr
    assert "valid for 1 ranks" in good.stdout
    bad = _dry_run(recipe, "--moe-use-upcycling", "--num-experts", "3",
                   "--moe-upcycling-granularity", "2")  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: config error: --num-experts = 3: must be a multiple of "
        "--moe-upcycling-granularity = 2: each dense FFN becomes 2 experts (role train)"
    ]


def test_roles_that_would_load_different_moe_models_are_refused(recipe):
    text = recipe.read_text().replace(
        "roles:\n", "roles:\n  ref: {megatron: {moe_upcycling_granularity: 2}}\n"
    )
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=r"--moe-use-upcycling = .*must upcycle model.hf_path "
                       r"alike for every role that loads it"):  # fmt: skip
        resolve(recipe, [], ["--moe-use-upcycling", "--num-experts", "4"])


def test_a_role_with_its_own_checkpoint_is_refused(recipe, tmp_path):
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "config.json").write_text(json.dumps(QWEN3))
    (critic / "model.safetensors").write_bytes(b"")
    text = recipe.read_text().replace("[train, logp, ref]", "[train, logp, ref, critic]")
    recipe.write_text(
        text + f"critic: {{init: {critic}}}\nalgorithm: {{advantage_estimator: gae}}\n"
    )
    with pytest.raises(ConfigError, match=r"--moe-use-upcycling = True: upcycles "
                       r"model.hf_path, but role critic loads its own checkpoint"):  # fmt: skip
        resolve(recipe, ["roles.critic.megatron.lr=1.0e-5"],
                ["--moe-use-upcycling", "--num-experts", "4"])  # fmt: skip


def test_upcycling_needs_model_hf_path(recipe):
    text = recipe.read_text().replace("seq_length: 64,", "seq_length: 64, num_layers: 2, "
                                      "hidden_size: 64, num_attention_heads: 4,")  # fmt: skip
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=r"model.hf_path = None: --moe-use-upcycling upcycles "
                       r"a dense HF checkpoint"):  # fmt: skip
        resolve(recipe, ["model.hf_path=null"], ["--moe-use-upcycling", "--num-experts", "4"])
