"""The real entry point, as a user runs it: `launch/torchrun.sh` / `python -m ...train`.

Contracts checked:
- the main job on 4 CPU ranks (train TP=2, logp, ref) loads one tiny HF checkpoint into every
  role, their per-token log-probs agree with each other and with `transformers` within 1e-5,
  `config.resolved.yaml` is written and resolves again, and `--save` exports the train role's
  weights as a HF checkpoint byte-identical to the one loaded;
- a bad recipe or flag ends with exit code 2 and one `error:` line naming the key, with no
  traceback, both from `python -m megatron_async_rl.train` and through `launch/torchrun.sh`
  (which validates in one process before starting torchrun).
Nothing is faked: real torchrun, megatron-core, gloo and transformers.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "yaml_configs" / "tiny-cpu.yaml"
pytestmark = pytest.mark.e2e


def _env():
    env = dict(os.environ)
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT="29611")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from megatron_async_rl.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", "llama", seed=0)


def test_main_job_on_four_ranks(tiny_llama, tmp_path):
    run_dir, export = tmp_path / "run", tmp_path / "export"
    cmd = [
        "bash", str(REPO / "launch" / "torchrun.sh"), str(RECIPE),
        "--set", f"model.hf_path={tiny_llama}", "--run-dir", str(run_dir),
        "--", "--save", str(export),
    ]  # fmt: skip
    env = _env() | {"NPROC_PER_NODE": "4"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "role check" in proc.stdout and "done: outputs in" in proc.stdout

    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    diffs = {k: v for k, v in metrics.items() if k.endswith("_max_abs_diff")}
    assert set(diffs) >= {
        "logprob/logp_vs_train_max_abs_diff",
        "logprob/ref_vs_train_max_abs_diff",
        "logprob/hf_vs_train_max_abs_diff",
    }
    assert max(diffs.values()) <= 1e-5, diffs

    from megatron_async_rl.config.recipe import resolve

    resolved = resolve(run_dir / "config.resolved.yaml", [], [])
    assert resolved.role_megatron_args["train"]["tensor_model_parallel_size"] == 2
    assert resolved.role_megatron_args["train"]["save"] == str(export)

    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    original, exported = load_hf_state_dict(tiny_llama), load_hf_state_dict(export)
    assert exported.keys() == original.keys()
    assert all(exported[k].equal(original[k]) for k in original)


BAD = [
    (["--set", "roles.grups=1"], "roles.grups"),
    (["--", "--lr", "two"], "--lr"),
    (["--", "--hidden-sise", "64"], "--hidden-sise"),
    (["--set", "model.hf_path=/no/such/dir"], "model.hf_path"),
    (["--set", "roles.train.megatron.tensor_model_parallel_size=3"], "--num-attention-heads"),
    (["--world-size", "5"], "rank counts must sum to the world size 5"),
]


@pytest.mark.parametrize("args,key", BAD, ids=[key for _, key in BAD])
def test_bad_input_exits_2_with_one_line(args, key, tiny_llama):
    cmd = [sys.executable, "-m", "megatron_async_rl.train", "--config", str(RECIPE)]
    cmd += ["--set", f"model.hf_path={tiny_llama}", "--dry-run", "--world-size", "4", *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert key in lines[0] and "Traceback" not in proc.stderr


def test_launch_script_validates_before_starting_ranks(tiny_llama):
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(RECIPE)]
    cmd += ["--set", f"model.hf_path={tiny_llama}", "--", "--num-layers", "x"]
    proc = subprocess.run(cmd, env=_env() | {"NPROC_PER_NODE": "4"}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: config error: --num-layers = 'x': expected an integer"
    ] or proc.stderr.startswith("error: config error: --num-layers"), proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_dry_run_prints_the_layout(tiny_llama):
    cmd = [sys.executable, "-m", "megatron_async_rl.train", "--config", str(RECIPE)]
    cmd += ["--set", f"model.hf_path={tiny_llama}", "--dry-run", "--world-size", "4"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "valid for 4 ranks" in proc.stdout and "train" in proc.stdout
