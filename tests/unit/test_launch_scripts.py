"""The command lines that `launch/torchrun.sh` and `launch/slurm.sbatch` build.

Contract checked, mostly through `DRY_RUN=1` (the script prints its command on one line, shell-
quoted, and exits 0; the line is parsed here with `shlex`):

- torchrun.sh: `PYTHON -m torch.distributed.run --nnodes 1 --nproc-per-node N --master-addr A
  --master-port P [TORCHRUN_EXTRA_ARGS] -m megatron_async_rl.train --config RECIPE
  [--run-dir RUN_DIR] ARGS...`, N defaulting to the GPU count, else 4;
- slurm.sbatch: `srun --kill-on-bad-exit=1 --ntasks=NNODES --ntasks-per-node=1
  [--cpus-per-task=C] PYTHON -m torch.distributed.run --nnodes NNODES --nproc-per-node G
  --rdzv-id ID --rdzv-backend c10d --rdzv-endpoint HOST:PORT [TORCHRUN_EXTRA_ARGS]
  -m megatron_async_rl.train --config RECIPE [--run-dir RUN_DIR] ARGS...`, with HOST the first
  host of the job's node list and ID the job id;
- ARGS, including `--` and the Megatron flags after it, pass through verbatim;
- without DRY_RUN the scripts exec exactly the printed command (recorded by fakes);
- before that, slurm.sbatch runs the real entry point's `--dry-run --world-size NODES*G
  --ranks-per-node G` on the 32-GPU MoE recipe: an allocation the layout does not fit (world
  size, an engine across two nodes) exits 2 with one `error:` line and srun never runs;
- a user's mistake exits 2 with a message naming the argument or variable and its value;
- the #SBATCH defaults sit before the first command (sbatch ignores any later ones).

Faked: `scontrol`, `nvidia-smi` and `srun` are tiny scripts on PATH; the SLURM_* variables are
set by hand; PYTHON is a script that records its argv and environment. The real environment's
knobs and SLURM_* variables are removed so the tests run the same inside a SLURM job.
"""

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.processes import alive

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = REPO_ROOT / "launch" / "torchrun.sh"
SLURM_SBATCH = REPO_ROOT / "launch" / "slurm.sbatch"
PY = sys.executable
TRAIN = ["-m", "megatron_async_rl.train", "--config", "recipe.yaml"]
PASS_THROUGH = [
    "--set", "x=y", "--set", "name=a b", "--",
    "--tensor-model-parallel-size", "2", "--lr", "1e-6",
]  # fmt: skip
KNOBS = (
    "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "PYTHON", "RUN_DIR", "OMP_NUM_THREADS",
    "TORCHRUN_EXTRA_ARGS", "DRY_RUN", "GPUS_PER_NODE", "RDZV_ID", "REPO_DIR", "VALIDATE_HERE",
    "ORPHAN_GRACE", "SHUTDOWN_TIMEOUT", "MAX_RESTARTS", "SKIP_VALIDATE",
)  # fmt: skip
FAKE_SLURM = {
    "SLURM_NNODES": "2",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu-[07-08]",
    "SLURM_GPUS_ON_NODE": "4",
}


def _write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """A working directory holding `recipe.yaml` and a `bin/` of fakes that goes first on PATH."""
    (tmp_path / "recipe.yaml").write_text("scheduler: {generate_ahead_steps: 1}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Only the exact node list of FAKE_SLURM expands, so a wrong argument fails the test.
    _write_exe(
        bin_dir / "scontrol",
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu-[07-08]" ] || exit 1\n'
        "printf 'gpu-07\\ngpu-08\\n'\n",
    )
    _write_exe(bin_dir / "nvidia-smi", "#!/bin/sh\nexit 9\n")  # a host without a GPU
    return tmp_path


def _run(sandbox: Path, script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("SLURM_")}
    base["PATH"] = f"{sandbox / 'bin'}{os.pathsep}{base['PATH']}"
    return subprocess.run(
        [str(script), *args],
        check=False,
        cwd=sandbox,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def _dry_argv(sandbox: Path, script: Path, *args: str, **env: str) -> list[str]:
    result = _run(sandbox, script, *args, DRY_RUN="1", **env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.count("\n") == 1, result.stdout
    return shlex.split(result.stdout)


def _torchrun(
    nproc: str, addr: str = "127.0.0.1", port: str = "29500", restarts="0", shutdown="120"
) -> list[str]:
    return [
        PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", nproc,
        "--master-addr", addr, "--master-port", port, "--max-restarts", restarts,
        "--shutdown-timeout", shutdown,
    ]  # fmt: skip


def _srun(nnodes: str, nproc: str, rdzv_id: str, endpoint: str, cpus: str = "") -> list[str]:
    return [
        "srun", "--kill-on-bad-exit=1", f"--ntasks={nnodes}", "--ntasks-per-node=1",
        *([f"--cpus-per-task={cpus}"] if cpus else []),
        PY, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", nproc,
        "--rdzv-id", rdzv_id, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--max-restarts", "0", "--shutdown-timeout", "120",
    ]  # fmt: skip


def test_torchrun_defaults_on_a_host_without_gpu(sandbox):
    argv = _dry_argv(sandbox, TORCHRUN_SH, "recipe.yaml")
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    default_python = str(venv_python) if os.access(venv_python, os.X_OK) else "python3"
    assert argv == [default_python, *_torchrun("4")[1:], *TRAIN]


def test_torchrun_nproc_defaults_to_the_gpu_count(sandbox):
    _write_exe(
        sandbox / "bin" / "nvidia-smi",
        "#!/bin/sh\necho 'GPU 0: H200 (UUID: GPU-a)'\n"
        "echo '  MIG 1g.18gb     Device  0: (UUID: MIG-b)'\necho 'GPU 1: H200 (UUID: GPU-c)'\n",
    )
    assert _dry_argv(sandbox, TORCHRUN_SH, "recipe.yaml", PYTHON=PY) == [*_torchrun("2"), *TRAIN]


def test_torchrun_knobs(sandbox):
    argv = _dry_argv(
        sandbox,
        TORCHRUN_SH,
        "recipe.yaml",
        *PASS_THROUGH,
        PYTHON=PY,
        NPROC_PER_NODE="3",
        MASTER_ADDR="10.1.2.3",
        MASTER_PORT="29601",
        RUN_DIR="runs/my run",
        MAX_RESTARTS="2",
        SHUTDOWN_TIMEOUT="90",
        TORCHRUN_EXTRA_ARGS=" --log-dir logs  --redirects 3 ",
    )
    assert argv == [
        *_torchrun("3", "10.1.2.3", "29601", "2", "90"), "--log-dir", "logs", "--redirects", "3",
        *TRAIN, "--run-dir", "runs/my run", *PASS_THROUGH,
    ]  # fmt: skip


def test_slurm_rendezvous_from_the_job_environment(sandbox):
    argv = _dry_argv(
        sandbox, SLURM_SBATCH, "recipe.yaml", PYTHON=PY, SLURM_CPUS_PER_TASK="16", **FAKE_SLURM
    )
    assert argv == [*_srun("2", "4", "4242", "gpu-07:29500", cpus="16"), *TRAIN]


def test_slurm_knobs_override_the_job_environment(sandbox):
    env = {k: v for k, v in FAKE_SLURM.items() if k != "SLURM_JOB_NODELIST"}  # scontrol unused
    argv = _dry_argv(
        sandbox,
        SLURM_SBATCH,
        "recipe.yaml",
        *PASS_THROUGH,
        **env,
        PYTHON=PY,
        GPUS_PER_NODE="8",
        MASTER_ADDR="head.example",
        MASTER_PORT="29700",
        RDZV_ID="my-rdzv",
        RUN_DIR="/scratch/run 1",
        TORCHRUN_EXTRA_ARGS="--max-restarts 1",
    )
    assert argv == [
        *_srun("2", "8", "my-rdzv", "head.example:29700"), "--max-restarts", "1",
        *TRAIN, "--run-dir", "/scratch/run 1", *PASS_THROUGH,
    ]  # fmt: skip


def test_slurm_defaults_gpus_and_python_from_the_submit_dir(sandbox):
    (sandbox / ".venv" / "bin").mkdir(parents=True)
    venv_python = _write_exe(sandbox / ".venv" / "bin" / "python", "#!/bin/sh\n")
    env = {k: v for k, v in FAKE_SLURM.items() if k != "SLURM_GPUS_ON_NODE"}
    argv = _dry_argv(sandbox, SLURM_SBATCH, "recipe.yaml", SLURM_SUBMIT_DIR=str(sandbox), **env)
    expected = [str(venv_python) if a == PY else a for a in _srun("2", "8", "4242", "gpu-07:29500")]
    assert argv == [*expected, *TRAIN]


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=["torchrun", "slurm"])
def test_args_pass_through_verbatim(sandbox, script):
    args = [*PASS_THROUGH, "", "it's", "*", "$HOME"]
    argv = _dry_argv(sandbox, script, "recipe.yaml", *args, PYTHON=PY, **FAKE_SLURM)
    assert argv[-len(TRAIN) - len(args) :] == [*TRAIN, *args]


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=["torchrun", "slurm"])
def test_exec_runs_the_printed_command(sandbox, script):
    """PYTHON (and for SLURM, srun) are fakes recording argv and environment as JSON."""
    record = sandbox / "record.json"
    recorder = (
        f"#!{PY}\nimport json, os, pathlib, sys\n"
        f"pathlib.Path({str(record)!r}).write_text("
        "json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n"
    )
    fake_python = _write_exe(sandbox / "fake-python", recorder)
    _write_exe(sandbox / "bin" / "srun", recorder)
    env = {"PYTHON": str(fake_python), "SLURM_SUBMIT_DIR": str(REPO_ROOT), **FAKE_SLURM}
    printed = _dry_argv(sandbox, script, "recipe.yaml", *PASS_THROUGH, **env)

    result = _run(sandbox, script, "recipe.yaml", *PASS_THROUGH, **env)
    assert result.returncode == 0, result.stderr
    recorded = json.loads(record.read_text())
    assert recorded["argv"] == printed[1:]
    assert recorded["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    if script == TORCHRUN_SH:  # no GPU: one thread per rank unless the user chose
        assert recorded["env"]["OMP_NUM_THREADS"] == "1"


def test_torchrun_keeps_a_chosen_omp_num_threads(sandbox):
    record = sandbox / "record.json"
    fake_python = _write_exe(
        sandbox / "fake-python",
        f"#!/bin/sh\nprintf '%s' \"$OMP_NUM_THREADS\" > {shlex.quote(str(record))}\n",
    )
    result = _run(sandbox, TORCHRUN_SH, "recipe.yaml", PYTHON=str(fake_python), OMP_NUM_THREADS="6")
    assert result.returncode == 0, result.stderr
    assert record.read_text() == "6"


ERRORS = [
    (TORCHRUN_SH, [], {}, r"missing argument RECIPE"),
    (TORCHRUN_SH, ["absent.yaml"], {}, r"RECIPE='absent\.yaml' is not a file"),
    (TORCHRUN_SH, ["recipe.yaml"], {"NPROC_PER_NODE": "0"}, r"NPROC_PER_NODE='0'.*positive"),
    (TORCHRUN_SH, ["recipe.yaml"], {"NPROC_PER_NODE": "two"}, r"NPROC_PER_NODE='two'.*positive"),
    (TORCHRUN_SH, ["recipe.yaml"], {"NPROC_PER_NODE": "1.5"}, r"NPROC_PER_NODE='1\.5'"),
    (TORCHRUN_SH, ["recipe.yaml"], {"MASTER_PORT": "70000"}, r"MASTER_PORT='70000'.*1\.\.65535"),
    (TORCHRUN_SH, ["recipe.yaml"], {"MAX_RESTARTS": "-1"}, r"MAX_RESTARTS='-1'.*integer >= 0"),
    (TORCHRUN_SH, ["recipe.yaml"], {"SHUTDOWN_TIMEOUT": "0"}, r"SHUTDOWN_TIMEOUT='0'.*positive"),
    (TORCHRUN_SH, ["recipe.yaml"], {"ORPHAN_GRACE": "-3"}, r"ORPHAN_GRACE='-3'.*positive"),
    (SLURM_SBATCH, ["recipe.yaml"], {**FAKE_SLURM, "REQUEUE": "yes"}, r"REQUEUE='yes'.*0 or 1"),
    (TORCHRUN_SH, ["recipe.yaml"], {"PYTHON": "no-such-python"}, r"PYTHON='no-such-python'"),
    (SLURM_SBATCH, [], FAKE_SLURM, r"missing argument RECIPE"),
    (SLURM_SBATCH, ["absent.yaml"], FAKE_SLURM, r"RECIPE='absent\.yaml' is not a file"),
    (SLURM_SBATCH, ["recipe.yaml"], {}, r"SLURM_NNODES is not set"),
    (SLURM_SBATCH, ["recipe.yaml"], {**FAKE_SLURM, "SLURM_NNODES": "0"}, r"SLURM_NNODES='0'"),
    (SLURM_SBATCH, ["recipe.yaml"], {**FAKE_SLURM, "GPUS_PER_NODE": "x"}, r"GPUS_PER_NODE='x'"),
    (SLURM_SBATCH, ["recipe.yaml"], {**FAKE_SLURM, "MASTER_PORT": "0"}, r"MASTER_PORT='0'"),
    (
        SLURM_SBATCH,
        ["recipe.yaml"],
        {**FAKE_SLURM, "SLURM_JOB_NODELIST": "other[1-2]"},
        r"scontrol show hostnames failed for SLURM_JOB_NODELIST='other\[1-2\]'",
    ),
    (
        SLURM_SBATCH,
        ["recipe.yaml"],
        {k: v for k, v in FAKE_SLURM.items() if k != "SLURM_JOB_ID"},
        r"RDZV_ID is empty and SLURM_JOB_ID is not set",
    ),
]


@pytest.mark.parametrize("script, args, env, message", ERRORS)
def test_user_errors_exit_2_naming_the_culprit(sandbox, script, args, env, message):
    result = _run(sandbox, script, *args, **{"DRY_RUN": "1", "PYTHON": PY, **env})
    assert result.returncode == 2
    assert result.stdout == ""
    assert re.search(message, result.stderr), result.stderr


def test_sbatch_directives_are_read_by_sbatch():
    """sbatch stops reading #SBATCH at the first command, so every directive must come first."""
    lines = SLURM_SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines[1:], 1) if not line.startswith("#"))
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert all(lines.index(d) < first_command for d in directives)
    for option in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--output=%x-%j.out"):
        assert f"#SBATCH {option}" in directives


MOE_RECIPE = str(REPO_ROOT / "yaml_configs" / "moe-32gpu-grpo-async.yaml")


def test_slurm_dry_run_of_the_moe_recipe(sandbox):
    env = {**FAKE_SLURM, "SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "8"}
    argv = _dry_argv(sandbox, SLURM_SBATCH, MOE_RECIPE, PYTHON=PY, **env)
    train = ["-m", "megatron_async_rl.train", "--config", MOE_RECIPE]
    assert argv == [*_srun("4", "8", "4242", "gpu-07:29500"), *train]


@pytest.mark.parametrize(
    "nodes, gpus, error",
    [
        ("4", "8", None),
        ("3", "8", "roles.groups[3].num_ranks = 8: rank counts must sum to the world size 24"),
        ("32", "1", "engine.tp_size = 2: the engine on ranks 24-25 of the 8-rank generate window"),
    ],
    ids=["4x8", "3x8", "32x1"],
)
def test_slurm_validates_the_moe_recipe_for_the_whole_world(sandbox, nodes, gpus, error):
    """The real entry point checks the layout (and engine placement per node) before srun."""
    record = sandbox / "record.json"
    _write_exe(
        sandbox / "bin" / "srun",
        f"#!{PY}\nimport json, pathlib, sys\n"
        f"pathlib.Path({str(record)!r}).write_text(json.dumps(sys.argv[1:]))\n",
    )
    # the cluster's checkpoint and data are not on this machine: check the layout alone
    env = {**FAKE_SLURM, "SLURM_NNODES": nodes, "GPUS_PER_NODE": gpus, "VALIDATE_HERE": "0"}
    result = _run(
        sandbox, SLURM_SBATCH, MOE_RECIPE, PYTHON=PY, SLURM_SUBMIT_DIR=str(REPO_ROOT), **env
    )
    if error is None:
        assert result.returncode == 0, result.stderr
        assert json.loads(record.read_text())[:3] == [
            "--kill-on-bad-exit=1",
            "--ntasks=4",
            "--ntasks-per-node=1",
        ]
    else:
        assert result.returncode == 2 and not record.exists()
        assert f"error: config error: {error}" in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in result.stderr


def test_slurm_help_prints_the_header_without_running_anything():
    script = REPO_ROOT / "launch" / "slurm.sbatch"
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]}, timeout=30)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    header = [line for line in script.read_text().splitlines()[1:] if line.startswith("#")]
    assert proc.stdout.splitlines()[0] == header[0].removeprefix("# ")
    assert "Usage: sbatch" in proc.stdout and "#SBATCH --nodes=2" in proc.stdout
    assert "set -euo" not in proc.stdout and not proc.stderr


def test_slurm_checks_the_paths_where_the_job_runs(sandbox):
    """By default the launcher's check runs with --here: a checkpoint missing on the batch node
    is one error line and exit 2 before srun (VALIDATE_HERE=0 turns it into a warning)."""
    env = {**FAKE_SLURM, "SLURM_NNODES": "4", "GPUS_PER_NODE": "8"}
    result = _run(
        sandbox, SLURM_SBATCH, MOE_RECIPE, PYTHON=PY, SLURM_SUBMIT_DIR=str(REPO_ROOT), **env
    )
    assert result.returncode == 2, result.stderr
    assert (
        "error: config error: model.hf_path = '/shared/checkpoints/qwen3-moe-16b-a3b': "
        "directory not found" in result.stderr
    )


FAKE_AGENT = """#!/usr/bin/env bash
# PYTHON for launch/torchrun.sh: the dry run passes; "torchrun" records the signals it gets
# and starts two fake ranks (Python, so they may trap SIGINT), then waits for them.
for a in "$@"; do [[ $a == --dry-run ]] && exit 0; done
trap 'echo agent-INT >> "$LOG"' INT
trap 'echo agent-TERM >> "$LOG"' TERM
for r in 0 1; do RANK=$r "$REAL_PYTHON" -c "$RANK_CODE" & done
while [[ -n $(jobs -rp) ]]; do wait; done
"""
RANK_CODE = """
import os, signal, sys, time
rank, log = os.environ["RANK"], os.environ["LOG"]
def stop(signum, frame):
    name = signal.Signals(signum).name
    open(log, "a").write(f"rank{rank}-{name}\\n")
    marker = {"SIGINT": "MEGATRON_ASYNC_RL_INTERRUPTED_FILE",
              "SIGTERM": "MEGATRON_ASYNC_RL_PREEMPTED_FILE"}[name]
    if rank == "0":
        open(os.environ[marker], "w").write("x")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
open(log, "a").write(f"rank{rank}-up\\n")
while True:
    time.sleep(0.05)
"""


def _default_sigint() -> None:
    """SIGINT as a terminal's shell leaves it: a test session started in the background
    inherits it ignored, and bash cannot trap a signal ignored on entry."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 83)])
def test_torchrun_sh_hands_signals_to_the_ranks_alone(sandbox, sig, code):
    """Ctrl-C (SIGINT to the launcher's whole process group, as a terminal sends it) and SIGTERM
    (to the launcher) reach the ranks, never torchrun (it would print a traceback and, on SIGINT,
    a failure summary); the leader's marker makes the launcher exit 130 or 83. The real stack's
    twin: tests/e2e/test_interrupt.py and test_checkpoint_resume.py."""
    log = sandbox / "signals.log"
    agent = _write_exe(sandbox / "fake-python", FAKE_AGENT)
    base = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("SLURM_")}
    env = {**base, "PATH": f"{sandbox / 'bin'}{os.pathsep}{base['PATH']}", "PYTHON": str(agent),
           "LOG": str(log), "REAL_PYTHON": sys.executable, "RANK_CODE": RANK_CODE}  # fmt: skip
    proc = subprocess.Popen([str(TORCHRUN_SH), "recipe.yaml"], cwd=sandbox, env=env,
                            start_new_session=True, preexec_fn=_default_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not (log.exists() and log.read_text().count("-up") == 2):
            assert time.monotonic() < deadline and proc.poll() is None, "fake ranks never started"
            time.sleep(0.05)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=20) == code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    got = sorted(line for line in log.read_text().split() if not line.endswith("-up"))
    name = sig.name.removeprefix("SIG")
    assert got == [f"rank0-SIG{name}", f"rank1-SIG{name}"], got


_FAKE_TORCHRUN = """#!/bin/bash
# A fake interpreter: the dry run passes; "torchrun" starts two "ranks" and waits for them.
# A rank writes its pid, then saves and exits on SIGTERM ({term}) as a real one does.
for arg in "$@"; do [[ $arg == --dry-run ]] && exit 0; done
echo $$ > {out}/torchrun.pid
for r in 0 1; do
    bash -c '{rank}' &
done
wait
"""


@pytest.mark.parametrize("ranks_stop_on_term", [True, False], ids=["ranks-stop", "ranks-hang"])
def test_a_launcher_killed_with_sigkill_leaves_no_job_running(sandbox, ranks_stop_on_term):
    """`kill -9` of the launcher: its watch stops the job as a preemption does (SIGTERM to the
    ranks), and kills torchrun and ranks that have not stopped ORPHAN_GRACE seconds later. The
    real stack's twin: tests/e2e/test_interrupt.py (a launcher killed mid-run)."""
    out = sandbox / "pids"
    out.mkdir()
    term = "exit 0" if ranks_stop_on_term else ""
    rank = (f"echo $$ >> {out}/ranks; trap \"echo saved >> {out}/saved; {term}\" TERM; "
            "while true; do sleep 0.2; done")  # fmt: skip
    fake = _write_exe(sandbox / "bin" / "fakepython",
                      _FAKE_TORCHRUN.format(out=out, rank=rank, term=term))  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("SLURM_")}
    env = {**base, "PATH": f"{sandbox / 'bin'}{os.pathsep}{base['PATH']}", "PYTHON": str(fake),
           "NPROC_PER_NODE": "2", "ORPHAN_GRACE": "3"}  # fmt: skip
    launcher = subprocess.Popen([str(TORCHRUN_SH), "recipe.yaml"], cwd=sandbox, env=env,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 20
    while not ((out / "ranks").exists() and len((out / "ranks").read_text().split()) == 2):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.1)
    pids = [int((out / "torchrun.pid").read_text()), *map(int, (out / "ranks").read_text().split())]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + (4 if ranks_stop_on_term else 8)
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "the job outlived its launcher"
    assert (out / "saved").read_text().split() == ["saved", "saved"]  # SIGTERM came first
    assert "the launcher (pid" in launcher.stderr.read()


def _alive(pid: int) -> bool:
    """Running and not a zombie (`tests.processes.alive`)."""
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False
