#!/usr/bin/env bash
# MoE routing replay on this machine's CPU: a tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2)
# learns the arithmetic task with asynchronous GRPO, its engine in bfloat16, its trainer in
# float32, and rollout routing replay (R3) on (yaml_configs/tiny-moe-r3-cpu.yaml).
#   1. install (scripts/setup_env.sh, first time only)
#   2. write the tiny MoE with a locally made tokenizer (nothing from a hub) and the task data
#   3. warm-start the model on the answer format (as the quick start does for its Llama)
#   4. run the recipe on 2 ranks (train+logp | SGLang engine returning routed experts)
# Outputs in runs/tiny-moe-r3: metrics.jsonl (moe/routing_agreement, moe/replay_agreement,
# mismatch/*), reward.png. Extra arguments go to the entry point (e.g. --set
# moe.routing_replay=off, or --set faults.allow=true --set faults.router_noise=1.0 for an
# induced routing mismatch).
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
bash scripts/setup_env.sh
py=.venv/bin/python
if [[ ! -f runs/tiny-qwen3-moe/config.json ]]; then
    "$py" -m megatron_async_rl.models.tiny --family qwen3_moe --out runs/tiny-qwen3-moe --seed 0
fi
if [[ ! -f runs/arith/train.jsonl ]]; then
    "$py" -m megatron_async_rl.tasks.arithmetic --out runs/arith/train.jsonl --num-rows 2000 \
        --seed 0
fi
if [[ ! -f runs/tiny-qwen3-moe-warm/config.json ]]; then
    "$py" -m megatron_async_rl.tasks.warm_start --model runs/tiny-qwen3-moe \
        --data runs/arith/train.jsonl --out runs/tiny-qwen3-moe-warm --seed 0
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-2} exec bash launch/torchrun.sh yaml_configs/tiny-moe-r3-cpu.yaml "$@"
