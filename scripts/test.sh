#!/usr/bin/env bash
# Install what the tests need (scripts/setup_env.sh) and run the whole CPU test suite.
# Extra arguments go to pytest. pytest's exit code 5 (no test collected) fails like any error.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest "$@"
