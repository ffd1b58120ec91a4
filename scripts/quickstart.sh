#!/usr/bin/env bash
# The main job on this machine's CPU: GRPO on a tiny model that learns single-digit addition.
#   1. install (scripts/setup_env.sh, first time only)
#   2. write a tiny Llama-style HF model with a locally made tokenizer (nothing from a hub)
#   3. write the task data ("3+5=" -> "8") and warm-start the model on the answer FORMAT only
#      (digits then <eos>, trained on mostly wrong answers: it starts well below 50% correct)
#   4. run yaml_configs/tiny-grpo-cpu.yaml on 2 ranks (train+logp | SGLang engine)
# Outputs in runs/tiny-grpo: metrics.jsonl, reward.png, config.resolved.yaml, tensorboard/.
# Extra arguments go to the entry point (e.g. --set trainer.num_steps=10, -- --lr 5e-4).
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
bash scripts/setup_env.sh
py=${PYTHON:-.venv/bin/python}  # PYTHON: another environment (e.g. .venv-megatron-core-0.19.2)
export PYTHON=$py
if [[ ! -f runs/tiny-llama/config.json ]]; then
    "$py" -m megatron_async_rl.models.tiny --family llama --out runs/tiny-llama --seed 0
fi
if [[ ! -f runs/arith/train.jsonl ]]; then
    "$py" -m megatron_async_rl.tasks.arithmetic --out runs/arith/train.jsonl --num-rows 2000 \
        --seed 0
fi
if [[ ! -f runs/arith/eval.jsonl ]]; then  # evaluation rows for the validation stage
    "$py" -m megatron_async_rl.tasks.arithmetic --out runs/arith/eval.jsonl --num-rows 64 \
        --seed 1
fi
if [[ ! -f runs/tiny-llama-warm/config.json ]]; then
    "$py" -m megatron_async_rl.tasks.warm_start --model runs/tiny-llama \
        --data runs/arith/train.jsonl --out runs/tiny-llama-warm --seed 0
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-2} exec bash launch/torchrun.sh yaml_configs/tiny-grpo-cpu.yaml "$@"
