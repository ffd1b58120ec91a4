#!/usr/bin/env bash
# Multi-turn tool use on this machine's CPU: a tiny model learns to add 3-digit numbers with a
# calculator tool (yaml_configs/tiny-tools-cpu.yaml).
#   1. install (scripts/setup_env.sh, first time only)
#   2. write a tiny Llama-style HF model with a locally made tokenizer (nothing from a hub)
#   3. write the task data ("348+576=" -> "924") and warm-start the model on the CALL FORMAT
#      (<tool_call>{"name": "add", ...}</tool_call>, the tool's answer, the final answer), with
#      the prompt's numbers in 75% of the calls and the tool's result copied in 75% of answers
#   4. run the recipe on 2 ranks (train+logp | SGLang engine and the tool's workers)
# Outputs in runs/tiny-tools: metrics.jsonl, reward.png, rollouts/ (each conversation).
# Extra arguments go to the entry point (e.g. --set scheduler.generate_ahead_steps=1).
# TASK=code: the code task instead (yaml_configs/tiny-code-cpu.yaml, outputs in runs/tiny-code):
# the model multiplies 3-digit numbers by writing print(a*b) for the built-in python tool, which
# runs it in the sandbox (bubblewrap, installed by the set-up script).
set -euo pipefail
task=${TASK:-sum}
case "$task" in
    sum) data=runs/calc/train.jsonl warm=runs/tiny-llama-tools-warm recipe=tiny-tools-cpu.yaml
         rows=megatron_async_rl.tasks.calculator ;;
    code) data=runs/code/train.jsonl warm=runs/tiny-llama-code-warm recipe=tiny-code-cpu.yaml
          rows=megatron_async_rl.tasks.code_task ;;
    *) echo "TASK=$task: must be sum or code" >&2; exit 2 ;;
esac
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
bash scripts/setup_env.sh
py=.venv/bin/python
if [[ ! -f runs/tiny-llama/config.json ]]; then
    "$py" -m megatron_async_rl.models.tiny --family llama --out runs/tiny-llama --seed 0
fi
if [[ ! -f $data ]]; then
    "$py" -m "$rows" --out "$data" --num-rows 2000 --seed 0
fi
if [[ ! -f $warm/config.json ]]; then
    "$py" -m megatron_async_rl.tasks.tool_warm_start --model runs/tiny-llama --task "$task" \
        --data "$data" --out "$warm" --seed 0 --args-fraction 0.75 --copy-fraction 0.75
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-2} exec bash launch/torchrun.sh "yaml_configs/$recipe" "$@"
