"""The GRPO job through the real entry point: `launch/torchrun.sh yaml_configs/tiny-grpo-cpu.yaml`.

Contracts checked:
- 4 steps on 2 CPU ranks (train+logp | a real SGLang engine) finish (the run the tests
  share, `sync_run` in tests/conftest.py); `metrics.jsonl` has one object per step with the
  documented keys; `reward.png` and `config.resolved.yaml` are written; each RL step runs 4
  optimizer steps (--global-batch-size 32 of 128 samples) and `actor/lr` follows the warm-up
  and cosine decay; step 0's samples are dumped to `rollouts/step_00000000.jsonl`, readable;
  at step 0 the engine's log-probs of its own tokens match the trainer's within 1e-3 (fp32);
  malformed dataset rows are reported with file and line and counted in the metrics.
- with restarts off (`engine.max_restarts: 0`), an engine that dies mid-run stops the run
  with a non-zero exit and an error naming the generate rank and the cause, instead of
  hanging.
Nothing is faked: real torchrun, megatron-core, gloo and SGLang; the engine is killed with a
real SIGKILL of its scheduler process.
"""

import importlib.util
import os
import signal
import subprocess
import time

import pytest

from tests.harness.recipes import RECIPE, launch_command, launch_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
REQUIRED_KEYS = {
    "step", "reward/mean", "reward/std", "response_len/mean", "entropy/mean",
    "actor/clip_frac", "actor/grad_norm", "throughput/tokens_per_s", "timing/generate_s",
    "timing/reward_s", "timing/logp_s", "timing/train_s", "timing/weight_sync_s",
    "logprob/engine_vs_train_abs_diff", "policy_lag/max",
}  # fmt: skip
ABSENT_KEYS = {"kl/mean", "timing/ref_s"}
"""The recipe places no ref role (no KL term): nothing computes the reference's log-probs."""


def test_the_shared_synchronous_run(sync_run):
    """The shared run's own contract (mini-batches and lr schedule included)."""
    rows = sync_run.rows
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        missing = REQUIRED_KEYS - row.keys()
        assert not missing, missing
        assert not ABSENT_KEYS & row.keys()
        assert row["policy_lag/max"] == 0  # synchronous: every token from the current policy
        assert row["actor/optimizer_steps"] == 4  # 128 samples / --global-batch-size 32
    lrs = [row["actor/lr"] for row in rows]  # the last optimizer step's of each RL step
    assert lrs[0] > 0 and lrs[1] < lrs[0]  # warm-up ends inside step 0, cosine decay after
    assert rows[0]["logprob/engine_vs_train_abs_diff"] <= 1e-3
    assert rows[0]["data/bad_rows/missing_answer"] == 1
    assert rows[0]["data/bad_rows/malformed_json"] == 1
    assert rows[0]["data/bad_rows/empty_prompt"] == 1
    assert "train.jsonl:202" in sync_run.stderr  # the malformed line, reported with file and line
    assert (sync_run.run_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (sync_run.run_dir / "config.resolved.yaml").is_file()
    # the rollout dump of step 0 (observability.dump_rollouts_every: 10): every sample, readable
    import json

    dump = sync_run.run_dir / "rollouts" / "step_00000000.jsonl"
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 128 and not (sync_run.run_dir / "rollouts" / "step_00000001.jsonl").exists()
    assert rows[0]["prompt"].endswith("=") and rows[0]["versions"] == [0, 0]
    assert {"response", "answer", "reward", "advantage", "finish_reason"} <= rows[0].keys()


def _scheduler_pids(root_pid):
    import psutil

    pids = []
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids


@pytest.mark.fault_soak  # a run killed mid-way: scripts/fault_checks.sh
def test_engine_death_stops_the_run_naming_the_rank(task, tmp_path):
    """With restarts off (`engine.max_restarts: 0`) a dead engine stops the run, naming the
    rank and the cause (with restarts: `tests/e2e/test_engine_faults.py`)."""
    run_dir = tmp_path / "run"
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", "trainer.num_steps=10000",
            "engine.max_restarts=0")  # fmt: skip
    proc = subprocess.Popen(
        launch_command(RECIPE, run_dir, *sets), env=launch_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the run never produced two steps"
            time.sleep(1)
        victims = _scheduler_pids(proc.pid)
        assert victims, "no SGLang scheduler process found under the run"
        os.kill(victims[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "EngineDiedError" in stderr and "global rank 1" in stderr, stderr[-4000:]
    assert "exited with code -9" in stderr, stderr[-4000:]


def test_an_error_only_a_non_leader_rank_finds_is_printed_once(task, tmp_path):
    """Under plain torchrun (no launcher check), a reward plug-in that does not import fails on
    the generate rank (global rank 1) only: that rank prints the one `error:` line before
    torchrun stops the others; nothing is lost, and no rank prints a traceback."""
    import sys

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "-m", "megatron_async_rl.train", "--config", str(RECIPE), "--run-dir", str(tmp_path),
        "--set", f"model.hf_path={task.model}", "--set", f"data.path={task.data}",
        "--set", "reward.name=no_such_reward_module_xyz:score",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: config error: reward.name = 'no_such_reward_module_xyz:score': cannot import "
        "module 'no_such_reward_module_xyz': ModuleNotFoundError: No module named "
        "'no_such_reward_module_xyz'; hint: check that it is on PYTHONPATH and imports cleanly"
    ], proc.stderr[-3000:]
    # no rank prints a traceback (rank 0's collective, cut by rank 1's exit, is its echo); the
    # torchrun agent's own ChildFailedError summary is torchrun's, as the launcher avoids it
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
