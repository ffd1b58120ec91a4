#!/usr/bin/env bash
# The fault-injection runs, left out of the default test command to keep it within its time
# (each starts real engines or whole runs and kills something: a minute or more on 2 CPU cores;
# pyproject.toml deselects the `fault_soak` marker):
#   - a killed engine scheduler restarted in place with the current weights, a hung one found
#     by the watchdog (tests/distributed/test_engine_restart.py);
#   - engines killed mid-run are restarted and the asynchronous run finishes
#     (tests/e2e/test_engine_faults.py); with restarts off, an engine death stops the run naming
#     the rank (tests/e2e/test_grpo_job.py);
#   - a crash and a preemption both resume to the end, a kill during a checkpoint save loses
#     nothing (tests/e2e/test_checkpoint_resume.py);
#   - Ctrl-C saves, stops and leaves no process (tests/e2e/test_interrupt.py);
#   - a preempted SLURM job saves, requeues itself and resumes (tests/cluster/test_slurm.py).
# What stays in the default suite: the same recovery logic in process with fakes (restarts,
# reassignment, watchdog, signal flags, checkpoint manager), a real engine's death reported
# (tests/distributed/test_sglang_engine.py), a real run resumed from a checkpoint
# (tests/e2e/test_checkpoint_resume.py).
#
#   scripts/fault_checks.sh [pytest args]      PYTHON: the interpreter [<repo>/.venv/bin/python]
# e.g. PYTHON=.venv-megatron-core-0.19.2/bin/python scripts/fault_checks.sh
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
[[ -n ${PYTHON:-} ]] || bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-.venv/bin/python}" -m pytest -m fault_soak tests/distributed tests/e2e tests/cluster "$@"
