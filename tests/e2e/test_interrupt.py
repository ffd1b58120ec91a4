"""Ctrl-C stops a run cleanly: one line, exit 130, outputs written, a checkpoint, no process left;
a launcher killed with SIGKILL takes its whole job with it.

Contract, on the real stack through `launch/torchrun.sh` (2 ranks: train+logp | a real
SGLang engine), the asynchronous loop (N = 1: its threads wait in collectives, the harder case;
the synchronous loop takes the same path through `checkpoint.manager.SignalFlag`): once two
steps are logged, SIGINT to the launcher's whole process group (what a terminal sends on
Ctrl-C) makes the run save at the next step boundary and stop:
- the launcher exits 130 and prints one `interrupted (Ctrl-C)` line naming the run directory,
  with no traceback (ranks, torchrun and SGLang alike);
- trace.json, timeline.png and a complete checkpoint exist;
- no process the run started (torchrun, ranks, engine hosts, SGLang) is left;
- the checkpoint is of a version past the two steps logged (the same command resumes from it:
  `tests/e2e/test_checkpoint_resume.py` resumes after the same save on SIGTERM).
The second Ctrl-C (stop at once) is `tests/unit/test_signal_flag.py`'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.harness.recipes import RECIPE, launch_command, launch_env
from tests.processes import alive, cmdline

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.fault_soak]  # scripts/fault_checks.sh


def _default_sigint() -> None:
    """In the launcher's process: SIGINT as a terminal's shell leaves it. A test session
    started in the background (`cmd &`, nohup, some CI runners) inherits SIGINT ignored, and
    bash cannot trap a signal ignored on entry: the launcher would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _launch(task, tmp_path, **popen) -> tuple[subprocess.Popen, Path, Path]:
    """The launcher on the asynchronous loop (200 steps: it is stopped long before), in a
    session of its own; (process, run directory, its log)."""
    run_dir = tmp_path / "run"
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", "trainer.num_steps=200",
            "scheduler.generate_ahead_steps=1")  # fmt: skip
    log = tmp_path / "launcher.log"
    proc = subprocess.Popen(
        launch_command(RECIPE, run_dir, *sets), env=launch_env(),
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, **popen,
    )  # fmt: skip
    return proc, run_dir, log


def _until_two_steps(proc, run_dir, log, seen: dict[int, psutil.Process]) -> None:
    """Wait until the run has logged two steps, noting every process the launcher started."""
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the run never logged two steps"
        seen.update({p.pid: p for p in _descendants(proc.pid)})
        time.sleep(0.5)
    seen.update({p.pid: p for p in _descendants(proc.pid)})


def test_ctrl_c_saves_stops_and_leaves_nothing(task, tmp_path):
    proc, run_dir, log = _launch(task, tmp_path, preexec_fn=_default_sigint)
    seen: dict[int, psutil.Process] = {}
    try:
        _until_two_steps(proc, run_dir, log, seen)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert proc.returncode == 130, out[-4000:]
    lines = [line for line in out.splitlines() if "interrupted (Ctrl-C)" in line]
    assert len(lines) == 1 and str(run_dir) in lines[0], out[-4000:]
    assert "Traceback" not in out and "terminate called" not in out, out[-4000:]
    assert (run_dir / "trace.json").stat().st_size > 0
    assert (run_dir / "timeline.png").stat().st_size > 0
    versions = [int(m.parent.name.split("_")[1])
                for m in (run_dir / "checkpoints").glob("step_*/manifest.json")]  # fmt: skip
    assert versions and max(versions) >= 2, versions
    time.sleep(2)
    left = [p for p in seen.values() if alive(p)]
    assert not left, [cmdline(p)[:200] for p in left]
    assert len(seen) >= 4, seen  # torchrun, two ranks, the engine host (and SGLang's)


def test_a_launcher_killed_with_sigkill_takes_its_job_with_it(task, tmp_path):
    """`kill -9` of the launcher mid-run (no signal handed on): within 30 s every process the
    run started (torchrun, ranks, engine host, SGLang's) is gone and `/dev/shm` holds nothing
    new: the launcher's watch stops the job as a preemption does."""
    shm_before = set(os.listdir("/dev/shm"))
    proc, run_dir, log = _launch(task, tmp_path)
    seen: dict[int, psutil.Process] = {}
    try:
        _until_two_steps(proc, run_dir, log, seen)
        proc.kill()  # the launcher alone, as `kill -9 PID` does
        proc.wait()
        killed = time.monotonic()
        while [p for p in seen.values() if alive(p)] and time.monotonic() < killed + 30:
            time.sleep(0.5)
        left = [p for p in seen.values() if alive(p)]
        gone_s = time.monotonic() - killed
    finally:
        for p in seen.values():
            if alive(p):
                p.kill()
    assert not left, [cmdline(p)[:200] for p in left]
    assert len(seen) >= 4, seen  # torchrun, two ranks, the engine host (and SGLang's)
    new_shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
    assert not new_shm, new_shm
    out = log.read_text()
    assert "the launcher (pid" in out and "died: stopping its job" in out, out[-4000:]
    print(f"job gone {gone_s:.1f} s after the launcher's SIGKILL; {len(seen)} processes")
