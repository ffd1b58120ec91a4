"""Faults in the middle of an asynchronous run: engines restarted in place, a corrupted weight
message sent again, reward faults scored 0, a killed rank restarted by torchrun; the run ends.

Contract, on the real stack through `launch/torchrun.sh` (2 ranks: train+logp | a real
SGLang engine), `yaml_configs/tiny-grpo-async-cpu.yaml` with weights loaded in flight, a
checkpoint every 2 steps and `MAX_RESTARTS=1`, 8 steps:
- once step 1 is logged, the engine's scheduler process is killed with SIGKILL from outside;
- the recipe's `faults:` section kills it again right after the weight load of step 4 began
  (the transfer dies half way), flips a byte of the first message of version 3 (with
  `weight_sync.max_attempts=1`: no second attempt), makes the
  first reward call of step 1 raise and that of step 4 hang (`reward.call_timeout_s` 5), and
  SIGKILLs global rank 0 (train) as its step 7 begins.
Each engine death is recovered in place (`engines.recovery.restarting`: the newest complete version
loaded, the open weight-update session restored); the corrupted message fails its checksum on
the only attempt and version 3 is skipped (`weight_sync.on_failure: keep_serving`: the engine
keeps serving v2, `weight_sync/failed_versions` 1, the next version loads as usual; a resend
heals the same fault in `tests/distributed/test_reshard_sglang.py`); the reward faults score 0
and are counted.
The rank kill makes the generate rank's collective fail at once, named (`CollectiveFailure`:
role, rank, stage, the torch.distributed call); torchrun restarts the world, which resumes from
the newest complete checkpoint (v6, or v4 while v6 is still written) without the kill (first
attempt only; an engine fault due before the resume point is not injected again). The launcher
exits 0 with steps 0-7 logged once each, two engine restarts, every fault counted once, the
ledger holding 128 prompts, none twice, and every token within one version of its step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest

from tests.harness.recipes import (
    RECIPE,
    end_of_run,
    launch_command,
    launch_env,
    logged_steps,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # crash-and-restart runs of the entry point

ASYNC_RECIPE = RECIPE.parent / "tiny-grpo-async-cpu.yaml"


def _scheduler(proc) -> int | None:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "scheduler" in p.name() and p.status() != psutil.STATUS_ZOMBIE:
                return p.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.fault_soak  # minutes: scripts/fault_checks.sh runs it
def test_killed_engines_are_restarted_and_the_asynchronous_run_finishes(task, tmp_path):
    run_dir = tmp_path / "run"
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", "trainer.num_steps=8",
            "scheduler.validation_every=0", "scheduler.weight_update_mode=in_flight",
            "rollout.max_new_tokens=16", "checkpoint.every_steps=2", "faults.allow=true",
            "faults.engine_kill_in_load_steps=[4]", "faults.weight_corrupt_versions=[3]",
            "weight_sync.max_attempts=1",
            "faults.reward_raise_steps=[1]", "faults.reward_hang_steps=[4]",
            "reward.call_timeout_s=5", "faults.rank_kill_steps=[7]",
            "faults.rank_kill_rank=0")  # fmt: skip
    env = dict(launch_env(), MAX_RESTARTS="1")
    proc = subprocess.Popen(launch_command(ASYNC_RECIPE, run_dir, *sets), env=env,
                            stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    proc.log = tmp_path / "run.log"
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 2, proc, "step 1")
        killed = _scheduler(proc)
        assert killed is not None, proc.log.read_text()[-3000:]
        os.kill(killed, signal.SIGKILL)
        out = end_of_run(proc)
    finally:  # a failed check leaves no run behind
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, out
    rows = logged_steps(run_dir)
    assert [r["step"] for r in rows] == list(range(8)), out
    assert sum(r.get("engines/restarts", 0) for r in rows) == 2, out
    for kind in ("engine_kill_in_load", "weight_corrupt", "reward_raise", "reward_hang"):
        assert sum(r.get(f"faults/injected/{kind}", 0) for r in rows) == 1, (kind, out)
    assert sum(r.get("weight_sync/failed_versions", 0) for r in rows) == 1, out
    assert max(r.get("reward/timeouts", 0) for r in rows) >= 1
    assert sum(r.get("engines/restart_s", 0) for r in rows) > 0
    resumed = [r["resume/from_step"] for r in rows if "resume/from_step" in r]
    assert resumed in ([6], [4]), out  # once, from the newest complete checkpoint
    assert rows[-1]["engines/healthy"] == 1
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == list(range(8))
    prompts = [uid for r in ledger for uid in r["prompts"]]
    assert len(prompts) == 8 * 16 and len(set(prompts)) == len(prompts)
    assert all(r["step"] - 1 <= r["versions"][0] <= r["versions"][1] <= r["step"] for r in ledger)
    log = proc.log.read_text()
    assert "engine restarted in" in log
    assert "global rank 0 kills itself (SIGKILL) at step 7" in log
    assert "collective torch.distributed." in log and "role generate, rank 1" in log, log[-6000:]
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == "zombie"
