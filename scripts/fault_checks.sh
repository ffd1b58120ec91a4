#!/usr/bin/env bash
# The long fault-injection runs of the whole job, left out of the default test command (each
# lasts minutes on 2 CPU cores; pyproject.toml deselects the `fault_soak` marker):
#   - engines killed mid-run are restarted and the asynchronous run finishes
#     (tests/e2e/test_engine_faults.py);
#   - a crash and a preemption both resume to the end (tests/e2e/test_checkpoint_resume.py);
#   - a preempted SLURM job saves, requeues itself and resumes (tests/cluster/test_slurm.py).
# Their shorter twins stay in the default suite: a killed or hung engine scheduler restarted
# (tests/distributed/test_engine_restart.py), a kill during a checkpoint save losing nothing
# (tests/e2e/test_checkpoint_resume.py), Ctrl-C and SIGTERM saving (tests/e2e/test_interrupt.py).
#
#   scripts/fault_checks.sh [pytest args]      PYTHON: the interpreter [<repo>/.venv/bin/python]
# e.g. PYTHON=.venv-megatron-core-0.19.2/bin/python scripts/fault_checks.sh
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
[[ -n ${PYTHON:-} ]] || bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-.venv/bin/python}" -m pytest -m fault_soak tests/e2e tests/cluster "$@"
