"""The real entry point, as a user runs it: `launch/torchrun.sh` / `python -m ...train`.

Contracts checked:
- the main job on 4 CPU ranks (train TP=2, logp, ref) loads one tiny HF checkpoint into every
  role, their per-token log-probs agree with each other and with `transformers` within 1e-5,
  `config.resolved.yaml` is written and resolves again, and `--save` exports the train role's
  weights as a HF checkpoint byte-identical to the one loaded;
- a bad recipe or flag ends with exit code 2 and one `error:` line naming the key, with no
  traceback, both from `python -m megatron_async_rl.train` and through `launch/torchrun.sh`
  (which validates in one process before starting torchrun).
Nothing is faked: real torchrun, megatron-core, gloo and transformers. Five of the six bad
inputs and the dry run call `train.main` in this process (the same code, without an
interpreter start each); one bad input still runs `python -m megatron_async_rl.train` in a
subprocess, for what only a fresh interpreter shows (import-time output on stderr). torchrun
gets a free port, so that runs can overlap.

Assertion mapping (before -> here): `test_bad_input_exits_2_with_one_line[key]` (6 subprocesses)
-> `test_bad_input_exits_2_with_one_line[key]` for 5 keys in process (exit code 2 from
`SystemExit`, one non-empty stderr line starting `error: ` and naming the key, no `Traceback`),
and `test_bad_input_in_a_fresh_interpreter_exits_2_with_one_line[--hidden-sise]`, the same
assertions on a subprocess. `test_dry_run_prints_the_layout`: return code 0 (was the exit
status), "valid for 4 ranks" and "train" on stdout, now in process. The main-job and launch
script tests are unchanged but for the port and the session's tiny model (`tiny_model`).
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "yaml_configs" / "tiny-cpu.yaml"
pytestmark = pytest.mark.e2e


def _env():
    env = dict(os.environ)
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def main_in_process(capsys):
    """`train.main(argv)` -> (return code or exit status, stdout, stderr); the logging set-up
    it installs (handlers bound to the captured stderr) is undone afterwards."""
    from megatron_async_rl.train import main

    names = ("", "megatron", "torch.distributed", "transformers", "httpx")
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    handlers = logging.getLogger().handlers[:]

    def run(argv):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    logging.getLogger().handlers[:] = handlers
    for logger, level in saved:
        logger.setLevel(level)


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

    from megatron_async_rl.recipe.load import resolve

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
    (["--set", "model.hf_path=/no/such/dir"], "model.hf_path"),
    (["--set", "roles.train.megatron.tensor_model_parallel_size=3"], "--num-attention-heads"),
    (["--world-size", "5"], "rank counts must sum to the world size 5"),
]
# Through a fresh interpreter: a Megatron flag, whose table may import megatron-core there.
BAD_IN_SUBPROCESS = [(["--", "--hidden-sise", "64"], "--hidden-sise")]


def _dry_run_argv(tiny_llama, args):
    argv = ["--config", str(RECIPE), "--set", f"model.hf_path={tiny_llama}", "--dry-run"]
    return argv + ["--world-size", "4", *args]


def _assert_one_error_line(code, stderr, key):
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert key in lines[0] and "Traceback" not in stderr


@pytest.mark.parametrize("args,key", BAD, ids=[key for _, key in BAD])
def test_bad_input_exits_2_with_one_line(args, key, tiny_llama, main_in_process):
    code, _, err = main_in_process(_dry_run_argv(tiny_llama, args))
    _assert_one_error_line(code, err, key)


@pytest.mark.parametrize("args,key", BAD_IN_SUBPROCESS, ids=[k for _, k in BAD_IN_SUBPROCESS])
def test_bad_input_in_a_fresh_interpreter_exits_2_with_one_line(args, key, tiny_llama):
    cmd = [sys.executable, "-m", "megatron_async_rl.train", *_dry_run_argv(tiny_llama, args)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    _assert_one_error_line(proc.returncode, proc.stderr, key)


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


def test_dry_run_prints_the_layout(tiny_llama, main_in_process):
    code, out, err = main_in_process(_dry_run_argv(tiny_llama, []))
    assert code == 0, err
    assert "valid for 4 ranks" in out and "train" in out


def test_dry_run_says_which_passes_a_step_runs_and_what_was_saved(tiny_llama, main_in_process):
    """The quick start places no ref (no KL term): the plan says so and what it saves; placed
    anyway with no use of it, the dry run warns; the train role alone takes its own log-probs."""
    quick = ["--config", str(REPO / "yaml_configs" / "tiny-grpo-cpu.yaml"), "--set",
             f"model.hf_path={tiny_llama}", "--dry-run", "--world-size", "2"]  # fmt: skip
    code, out, err = main_in_process(quick)
    assert code == 0, err
    assert "old log-probs: the logp role's pass" in out
    assert "ref: not placed (no KL term):" in out and "reference log-probs: not placed" in out
    sets = ["--set", "roles.groups[0].roles=[train, logp, ref]",
            "--set", "algorithm.kl_metrics_every=0"]  # fmt: skip
    code, out, err = main_in_process([*quick, *sets])
    assert code == 0, err
    assert "warning: ref: no KL term" in out
    sets = ["--set", "roles.groups[0].roles=[train]"]
    code, out, err = main_in_process([*quick, *sets])
    assert code == 0, err
    assert "old log-probs: the train forward's own, detached" in out
    assert "logp: not placed (old log-probs from the trainer)" in out
