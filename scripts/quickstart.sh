#!/usr/bin/env bash
# The main job on this machine's CPU: install (scripts/setup_env.sh), write a tiny HF model made
# locally (nothing from a hub), and run the 4-rank recipe yaml_configs/tiny-cpu.yaml through
# launch/torchrun.sh. Extra arguments go to the entry point (e.g. --set ..., -- --lr 1e-6).
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
bash scripts/setup_env.sh
if [[ ! -f runs/tiny-llama/config.json ]]; then
    .venv/bin/python -m megatron_async_rl.models.tiny --family llama --out runs/tiny-llama
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-4} exec bash launch/torchrun.sh yaml_configs/tiny-cpu.yaml "$@"
