"""Engines that fail in the middle of an asynchronous run: restarted in place, the run goes on.

Contract, on the real stack through `launch/torchrun.sh` (2 ranks: train+logp+ref | a real
SGLang engine), `yaml_configs/tiny-grpo-async-cpu.yaml` with weights loaded in flight and no
torchrun restarts, 8 steps:
- once step 2 is logged, the engine's scheduler process is killed with SIGKILL from outside;
- the recipe's `faults:` section kills it again right after the weight load of step 5 began
  (the transfer dies half way).
Each time the generate rank restarts its engine in place (`engines.restarting`), loads the
newest complete version into it, restores the open weight-update session and carries on; the
launcher exits 0 with steps 0-7 logged once each, two restarts counted (`engines/restarts`,
with their time; `faults/injected/engine_kill_in_load` 1), the ledger holding 128 prompts,
none twice, and every token within one version of its step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil

from tests.e2e.recipe_runs import RECIPE, launch_command, launch_env
from tests.e2e.test_checkpoint_resume import _end, _steps, _wait_for

ASYNC_RECIPE = RECIPE.parent / "tiny-grpo-async-cpu.yaml"


def _scheduler(proc) -> int | None:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "scheduler" in p.name() and p.status() != psutil.STATUS_ZOMBIE:
                return p.pid
        except psutil.Error:
            continue
    return None


def test_killed_engines_are_restarted_and_the_asynchronous_run_finishes(task, tmp_path):
    run_dir = tmp_path / "run"
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", "trainer.num_steps=8",
            "scheduler.validation_every=0", "scheduler.weight_update_mode=in_flight",
            "rollout.max_new_tokens=16", "checkpoint.every_steps=0", "faults.allow=true",
            "faults.engine_kill_in_load_steps=[5]")  # fmt: skip
    proc = subprocess.Popen(launch_command(ASYNC_RECIPE, run_dir, *sets), env=launch_env(29666),
                            stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    proc.log = tmp_path / "run.log"
    _wait_for(lambda: len(_steps(run_dir)) >= 3, proc, "step 2")
    killed = _scheduler(proc)
    assert killed is not None, proc.log.read_text()[-3000:]
    os.kill(killed, signal.SIGKILL)
    out = _end(proc)
    assert proc.returncode == 0, out
    rows = _steps(run_dir)
    assert [r["step"] for r in rows] == list(range(8)), out
    assert sum(r.get("engines/restarts", 0) for r in rows) == 2, out
    assert sum(r.get("faults/injected/engine_kill_in_load", 0) for r in rows) == 1, out
    assert sum(r.get("engines/restart_s", 0) for r in rows) > 0
    assert rows[-1]["engines/healthy"] == 1
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == list(range(8))
    prompts = [uid for r in ledger for uid in r["prompts"]]
    assert len(prompts) == 8 * 16 and len(set(prompts)) == len(prompts)
    assert all(r["step"] - 1 <= r["versions"][0] <= r["versions"][1] <= r["step"] for r in ledger)
    assert "engine restarted in" in proc.log.read_text()
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == "zombie"
