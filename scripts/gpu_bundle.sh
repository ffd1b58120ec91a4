#!/usr/bin/env bash
# The wheels the GPU test machine lacks for SGLang's engine and the GPU checks, computed from what
# an engine imports and the machine's documented package list (scripts/gpu_image_packages.txt),
# downloaded as cp312 wheels into .whl/ (git-ignored), which scripts/gpu_checks.sh installs from;
# the wheels and the repository together are checked against the carry limit (64 MiB).
#   bash scripts/gpu_bundle.sh [--limit-mib 64] [--also NAME==VERSION]
# Needs the CPU venv (scripts/setup_env.sh) and the package registry. See scripts/gpu_bundle.py.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
if [[ ! -x .venv/bin/python ]]; then
    echo "gpu_bundle.sh: no .venv; run scripts/setup_env.sh first" >&2
    exit 1
fi
exec .venv/bin/python scripts/gpu_bundle.py "$@"
