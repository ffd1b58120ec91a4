"""The 32-GPU MoE recipe and its `--dry-run` (`yaml_configs/moe-32gpu-grpo-async.yaml`).

Contract: `python -m megatron_async_rl.train --config RECIPE --dry-run --world-size 32` runs on a
CPU machine without the checkpoint: it exits 0, prints every role's window and parallel sizes
and the SGLang engines (engine.tp_size 2: hosts 24, 26, 28, 30), the device and host memory of
each role's busiest rank (`roles/memory.py`), and warns on one line that
`model.hf_path` was not checked. A wrong world size, engine TP split, EP split or MoE TP without
sequence parallelism exits 2 with one `error:` line naming the key, the value and the rule. A
real (non-dry) resolve of the same recipe still fails on the missing checkpoint. Where the
checkpoint directory exists, its config.json is read and the recipe's `megatron:` wins over it.
Nothing is faked: the entry point runs in a subprocess; the HF directory in the precedence test is
a hand-written qwen3_moe `config.json` plus an empty `model.safetensors`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.recipe.load import resolve

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "yaml_configs" / "moe-32gpu-grpo-async.yaml"
CHECKPOINT = "/shared/checkpoints/qwen3-moe-16b-a3b"


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_async_rl.train", "--config", str(RECIPE), "--dry-run"]
    return subprocess.run(
        [*cmd, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_dry_run_on_32_ranks_prints_the_layout():
    proc = _dry_run("--world-size", "32", "--ranks-per-node", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"recipe {RECIPE}: valid for 32 ranks on platform auto/auto")
    table = [line.split() for line in lines[2:7]]
    assert table == [
        ["ranks", "role", "tp", "pp", "cp", "ep", "etp", "dp", "edp"],
        ["0-15", "train", "1", "1", "1", "4", "1", "16", "4"],
        ["16-19", "logp", "2", "1", "1", "2", "1", "2", "2"],
        ["20-23", "ref", "1", "1", "1", "4", "1", "4", "1"],
        ["24-31", "generate", "-", "-", "-", "-", "-", "-", "-"],
    ]
    assert "4 SGLang engine(s) of engine.tp_size 2 on generate ranks 24-31" in lines[7]
    assert lines[8:12] == [
        f"  engine {i}: ranks {24 + 2 * i}-{25 + 2 * i}, host {24 + 2 * i}" for i in range(4)
    ]
    assert lines[12] == "nodes: 4 x 8 ranks (no engine spans two)"
    memory = {line.split()[0]: line for line in lines[14:18]}
    assert lines[13].startswith("memory per rank (busiest rank of each role;")
    # 16.0B weights in bf16 = 29.9 GiB; train EP4 holds a quarter of the experts (9.6 GiB) with
    # bf16 grads and Adam's fp32 state spread over DP16; engine hosts of the asynchronous loop
    # stage the whole model in /dev/shm every sync; logp ranks copy pieces into their slices.
    assert "device 22.8 GiB (weights 9.6 + grads 9.6 + optimizer 3.6)" in memory["train"]
    assert "device 14.9 GiB (weights 14.9)" in memory["logp"]
    assert "sync staging" not in memory["logp"] and "host 14.9 GiB" in memory["logp"]
    assert "sync staging 29.9" in memory["generate"]
    assert "sync staging" not in memory["ref"] and "engine weights 14.9" in memory["generate"]
    if not Path(CHECKPOINT).exists():
        warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
        assert len(warnings) == 2, proc.stderr  # one line per path this machine lacks
        assert (
            f"model.hf_path = '{CHECKPOINT}' not found on this machine: not checked"
            in (warnings[0])
        )
        assert (
            "data.path = '/shared/data/math/train.jsonl' not found on this machine" in (warnings[1])
        )


BAD = [
    (
        ["--world-size", "30"],
        "roles.groups[3].num_ranks = 8: rank counts must sum to the world size 30 (got 32)",
    ),
    (
        ["--world-size", "32", "--set", "engine.tp_size=3"],
        "engine.tp_size = 3: must divide the 8-rank generate window of roles.groups[3] "
        "(ranks 24-31): each engine spans tp_size consecutive generate ranks",
    ),
    (
        # generate on ranks 22-31 of 8-rank nodes: the TP5 engine 22-26 crosses node 2 -> 3
        ["--world-size", "32", "--ranks-per-node", "8", "--set", "engine.tp_size=5"]
        + ["--set", "roles.groups[2].num_ranks=2", "--set", "roles.groups[3].num_ranks=10"]
        + ["--set", "roles.ref.megatron.expert_model_parallel_size=2"],
        "engine.tp_size = 5: the engine on ranks 22-26 of the 10-rank generate window of "
        "roles.groups[3] (ranks 22-31) straddles nodes of 8 ranks",
    ),
    (
        ["--world-size", "32", "--set", "roles.train.megatron.expert_model_parallel_size=3"],
        "--num-experts = 64: must be divisible by --expert-model-parallel-size = 3 "
        "(resolved for role train)",
    ),
    (
        ["--world-size", "32", "--set", "roles.train.megatron.expert_model_parallel_size=32"],
        "roles.train.megatron.expert_model_parallel_size = 'ep=32 etp=1 pp=1': expert grid "
        "ep*etp*pp = 32 must divide the 16-rank window of roles.groups[0] (ranks 0-15)",
    ),
    (
        ["--world-size", "32", "--set", "roles.logp.megatron.sequence_parallel=false"],
        "--sequence-parallel = False: MoE with --tensor-model-parallel-size = 2 needs sequence "
        "parallelism (resolved for role logp)",
    ),
    (
        ["--world-size", "32", "--set", "roles.ref.megatron.tensor_model_parallel_size=8"],
        "--num-query-groups = 4: must be divisible by --tensor-model-parallel-size = 8 "
        "(resolved for role ref)",
    ),
]


@pytest.mark.parametrize("args, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_layout_exits_2_naming_key_value_rule(args, message):
    assert _error_line(_dry_run(*args)).startswith(f"error: config error: {message}")


def test_real_resolve_still_needs_the_checkpoint(tmp_path):
    absent = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"model.hf_path = '.*absent': directory not found"):
        resolve(RECIPE, [f"model.hf_path={absent}"], [])
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_async_rl.train", "--config", str(RECIPE)]
        + ["--set", f"model.hf_path={absent}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert _error_line(proc).startswith(f"error: config error: model.hf_path = '{absent}'")


def test_dry_resolve_uses_the_recipe_architecture(tmp_path, caplog):
    absent = str(tmp_path / "absent")
    with caplog.at_level(logging.WARNING, logger="megatron_async_rl.recipe.load"):
        cfg = resolve(RECIPE, [f"model.hf_path={absent}"], [], check_paths=False)
    assert [r.getMessage() for r in caplog.records] == [
        f"model.hf_path = '{absent}' not found on this machine: not checked (dry run); "
        "the architecture comes from the recipe's megatron: sections alone"
    ]
    train, logp = cfg.role_megatron_args["train"], cfg.role_megatron_args["logp"]
    assert (train["num_layers"], train["hidden_size"], train["num_experts"]) == (48, 2048, 64)
    assert (train["moe_ffn_hidden_size"], train["moe_router_topk"]) == (768, 8)
    assert (logp["tensor_model_parallel_size"], logp["sequence_parallel"]) == (2, True)
    assert (cfg.engine.tp_size, cfg.scheduler.generate_ahead_steps) == (2, 1)
    assert cfg.algorithm.off_policy_correction == "tis_token"
    layout = cfg.plan_layout(32, ranks_per_node=8)
    assert layout.engine_host_ranks() == (24, 26, 28, 30)


def test_dry_run_without_recipe_architecture_still_needs_the_checkpoint(tmp_path):
    """A recipe relying on config.json cannot be checked without it: the path stays an error."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{hf_path: {tmp_path / 'absent'}}}\n"
        "roles: {groups: [{roles: [train, logp, ref], num_ranks: 1}]}\n"
        "megatron: {lr: 1.0e-5}\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"model.hf_path = .*: directory not found; hint: a dry run skips a missing "
        r"checkpoint only when megatron: sets num_layers, hidden_size, num_attention_heads",
    ):
        resolve(recipe, [], [], check_paths=False)


def test_a_present_checkpoint_is_read_and_must_agree_with_the_recipe(tmp_path):
    """The recipe spells the architecture out for dry runs without the checkpoint; where the
    checkpoint exists, a recipe value that differs from its config.json is refused (the engines
    build the checkpoint's architecture)."""
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    hf = {
        "model_type": "qwen3_moe",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.05,
    }
    (model / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"--num-layers = 48: differs from model.hf_path's "
                       r"config.json \(4; role train\)"):  # fmt: skip
        resolve(RECIPE, [f"model.hf_path={model}"], [], check_paths=False)
    (model / "config.json").unlink()  # present but broken: a dry run checks it too
    with pytest.raises(ConfigError, match=r"has no config.json"):
        resolve(RECIPE, [f"model.hf_path={model}"], [], check_paths=False)
