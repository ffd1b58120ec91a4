"""`launch/slurm.sbatch` under a real single-node SLURM (munge, slurmctld, slurmd on this host).

Contracts checked:
- `sbatch launch/slurm.sbatch yaml_configs/tiny-grpo-cpu.yaml` (the production script, its
  requests shrunk on the command line: 1 node, no GPU, 2 CPUs) runs its pre-launch dry run,
  then one torchrun agent under srun with c10d rendezvous, and the tiny GRPO run completes,
  through a preemption (below): every step in metrics.jsonl, the job's output file written;
- a bad recipe value stops the job in the pre-launch dry run: the job fails with the entry
  point's one-line error naming the key, the value and the rule, and no rank ever starts;
- SLURM's preemption signal to the batch shell makes the ranks save at a step boundary; the
  script requeues the job, which resumes from that checkpoint and finishes, every step logged
  once.
The cluster is real (Debian's slurm 22.05 packages, installed in the fixture where missing;
the tests skip, saying why, only where they cannot be installed or started).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.slurm import CannotRun, SlurmCluster
from tests.harness.ports import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        slurm = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    except CannotRun as why:
        pytest.skip(f"no SLURM here: {why}")
    yield slurm
    slurm.stop()


def _sbatch(cluster, tmp_path, task, *sets: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "job.out"
    env = dict(cluster.env, GPUS_PER_NODE="2", RUN_DIR=str(tmp_path / "run"),
               PYTHON=sys.executable, MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [
        "sbatch", "--wait", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=20",
        f"--output={out}", str(REPO / "launch" / "slurm.sbatch"),
        str(REPO / "yaml_configs" / "tiny-grpo-cpu.yaml"),
    ]  # fmt: skip
    for item in (f"model.hf_path={task.model}", f"data.path={task.data}", *sets):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    return proc, out.read_text() if out.exists() else ""


def test_a_bad_value_stops_in_the_dry_run_before_any_rank_starts(cluster, task, tmp_path):
    proc, output = _sbatch(cluster, tmp_path, task, "trainer.num_steps=-3")
    assert proc.returncode != 0, output
    errors = [line for line in output.splitlines() if "trainer.num_steps" in line]
    assert errors and "-3" in errors[0] and "must be" in errors[0], output[-4000:]
    assert "layout on" not in output and not (tmp_path / "run").exists(), output[-4000:]
    assert os.path.exists(cluster.conf) and "idle" in cluster.sinfo()


_TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
             "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # fmt: skip


def _job_state(cluster, job: str) -> str:
    """The job's JobState, "GONE" once slurmctld forgot it. A failed query on a loaded machine
    (a socket timeout) is asked again, never read as "the job ended": that made CI stop waiting
    while the job sat requeued."""
    import time

    for _ in range(30):
        proc = subprocess.run(["scontrol", "show", "job", "-o", job], env=cluster.env,
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode == 0:
            for field in proc.stdout.split():
                if field.startswith("JobState="):
                    return field.split("=", 1)[1]
        elif "Invalid job id" in proc.stderr:
            return "GONE"
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job} kept failing: {proc.stderr[-500:]}")


@pytest.mark.fault_soak  # minutes: scripts/fault_checks.sh runs it
def test_a_preempted_job_saves_requeues_itself_and_resumes(cluster, task, tmp_path):
    """SLURM's preemption signal to the batch shell (`scancel --signal=TERM --batch`, what
    `--signal=B:TERM@180` sends before the time limit): the ranks save at the next step
    boundary, the script requeues the job, and the requeued job resumes and finishes; every
    step is logged exactly once."""
    import time

    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    env = dict(cluster.env, GPUS_PER_NODE="2", RUN_DIR=str(run_dir), PYTHON=sys.executable,
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [
        "sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
        "--time=20", f"--output={out}", str(REPO / "launch" / "slurm.sbatch"),
        str(REPO / "yaml_configs" / "tiny-grpo-cpu.yaml"),
    ]  # fmt: skip
    for item in (f"model.hf_path={task.model}", f"data.path={task.data}", "trainer.num_steps=10"):
        cmd += ["--set", item]
    job = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip().split(";")[0]  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        state = _job_state(cluster, job)
        assert time.monotonic() < deadline and state not in _TERMINAL | {"GONE"}, (
            state, out.read_text()[-3000:])  # fmt: skip
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job], env=cluster.env, check=True)
    states, pending_since = [_job_state(cluster, job)], None
    while states[-1] not in _TERMINAL | {"GONE"}:  # requeued (pending, BeginTime), then run again
        assert time.monotonic() < deadline, (states, out.read_text()[-3000:])
        reason = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], env=cluster.env,
                                capture_output=True, text=True).stdout  # fmt: skip
        if "BeginTime" in reason:
            pending_since = pending_since or time.monotonic()
            # SLURM delays a requeued job: release it, but not within the seconds after its
            # first run ended. slurmd revokes the job's credential then, at a resolution of
            # one second, and a start in that second failed on CI-like load: "Killing
            # non-startable batch job: Job credential revoked" (FAILED).
            if time.monotonic() - pending_since > 3:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                               env=cluster.env, capture_output=True)  # fmt: skip
        time.sleep(1)
        if (state := _job_state(cluster, job)) != states[-1]:
            states.append(state)
    assert states[-1] == "COMPLETED", (states, out.read_text()[-3000:])
    output = out.read_text()
    assert "preempted" in output and "checkpoint saved; exit 83" in output, output[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10)), output[-4000:]
    resumed = [r for r in rows if "resume/from_step" in r]
    assert len(resumed) == 1 and resumed[0]["step"] >= 2
    assert (run_dir / "checkpoints" / "step_00000010" / "manifest.json").exists()
    assert "idle" in cluster.sinfo()
