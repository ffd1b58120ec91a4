#!/usr/bin/env bash
# Faults in multi-turn rollouts, for real: the tool-use recipe with a tool that hangs, raises or
# answers with 1 MB of text (benchmarks/flaky_tools.py:add, by its arguments), plus malformed
# calls the model writes itself; then an environment that raises in reset for a quarter of the
# prompts. Each run must finish; the script prints the per-step counts.
#   bash scripts/multiturn_faults.sh [out_dir]   (needs runs/ from scripts/tools_quickstart.sh's
#                                                  steps 2-3, or benchmarks/multiturn_tools.py's)
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
out=${1:-runs/multiturn-faults}
model=${MODEL:-runs/bench-tools/tiny-llama-tools-warm}
data=${DATA:-runs/bench-tools/calc.jsonl}
export NPROC_PER_NODE=2 PYTHONPATH="$repo_dir${PYTHONPATH:+:$PYTHONPATH}"
common=(--set "model.hf_path=$model" --set "data.path=$data" --set trainer.num_steps=6)
MASTER_PORT=29821 bash launch/torchrun.sh yaml_configs/tiny-tools-cpu.yaml --run-dir "$out/tools" \
    "${common[@]}" --set "environment.tools=[benchmarks.flaky_tools:add]" \
    --set environment.tool_timeout_s=2 > "$out-tools.log" 2>&1
MASTER_PORT=29822 bash launch/torchrun.sh yaml_configs/tiny-tools-cpu.yaml --run-dir "$out/env" \
    "${common[@]}" --set trainer.num_steps=3 --set "environment.tools=[]" \
    --set environment.name=benchmarks.flaky_tools:FlakyReset > "$out-env.log" 2>&1
.venv/bin/python - "$out" <<'PY'
import json, sys
for run in ("tools", "env"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    keys = ("multiturn/trajectories", "multiturn/tool_calls", "multiturn/tool_errors",
            "multiturn/tool_results_truncated", "multiturn/env_errors", "reward/mean")
    for row in rows:
        print(run, row["step"], {k.split("/")[-1]: round(row.get(k, 0.0), 3) for k in keys})
PY
