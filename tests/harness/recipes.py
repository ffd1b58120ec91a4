"""Running a recipe through `launch/torchrun.sh` from a test, and what a run leaves.

Used by tests/e2e, tests/cluster and the session fixtures of `tests/conftest.py` (imported there
inside the fixtures, so that a unit run does not load it). Every launch gets its own free port
(`ports.free_port`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.harness.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "yaml_configs" / "tiny-grpo-cpu.yaml"
SYNC_SETS = (
    "trainer.num_steps=4",
    "scheduler.validation_every=2",
    "megatron.global_batch_size=32",
    "megatron.lr_warmup_iters=2",
    "megatron.lr_decay_style=cosine",
    "megatron.min_lr=1.0e-4",
    "checkpoint.every_steps=2",
)
"""The shared synchronous run: 4 steps, validation of versions 0 and 2, 4 optimizer steps of 32
samples per RL step (rollout batch 128) under a warm-up of 2 and a cosine decay to 1e-4,
checkpoints of versions 2 and 4 (`test_checkpoint_resume` resumes from version 2)."""


@dataclasses.dataclass(frozen=True)
class Task:
    model: Path
    data: Path
    val: Path


@dataclasses.dataclass(frozen=True)
class Run:
    rows: list[dict]
    stderr: str
    run_dir: Path


def launch_command(recipe: Path, run_dir: Path, *sets: str) -> list[str]:
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(recipe), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def launch_env(nproc: int = 2, validate: bool = False) -> dict[str, str]:
    """The launcher's environment: `nproc` ranks on this host, a free `MASTER_PORT`. Without
    `validate`, the launcher's check of the recipe before the ranks start (a dry run: ~9 s on 2
    cores, before every launch) is skipped and the ranks check it themselves; the check itself
    is `test_entry_point.py`'s, whose runs use the launcher as a user does."""
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE=str(nproc),
               MASTER_PORT=str(free_port()), SKIP_VALIDATE="0" if validate else "1")  # fmt: skip
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_recipe(task: Task, run_dir: Path, *sets: str) -> Run:
    """`yaml_configs/tiny-grpo-cpu.yaml` on 2 ranks with the task's model and data; must succeed."""
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", *sets)
    proc = subprocess.run(
        launch_command(RECIPE, run_dir, *sets), env=launch_env(), capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return Run([json.loads(line) for line in lines], proc.stderr, run_dir)


def end_of_run(proc, timeout: float = 600) -> str:
    """Wait for the launcher `proc` to exit; the end of its log (`proc.log`, a file)."""
    proc.wait(timeout=timeout)
    return proc.log.read_text()[-3000:]


def wait_for(condition, proc, what: str, timeout: float = 600):
    """Poll `condition` until true; fail naming `what` if `proc` ends first or time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n"
                                 + proc.log.read_text()[-4000:])  # fmt: skip
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run_dir):
    """The rows `metrics.jsonl` holds so far (none before it exists)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a zombie (a rank's finished checkpoint writer)
        return ""


def launcher_ranks(proc) -> list:
    """The torchrun workers (the ranks, `psutil.Process`) under the launcher `proc`: the
    agent's own children, not the processes a rank forks (checkpoint writers share its command
    line)."""
    agents = [
        p for p in psutil.Process(proc.pid).children(recursive=True)
        if "torch.distributed.run" in _cmdline(p)
    ]  # fmt: skip
    return [
        p for agent in agents for p in agent.children()
        if "megatron_async_rl.train" in _cmdline(p)
    ]  # fmt: skip
