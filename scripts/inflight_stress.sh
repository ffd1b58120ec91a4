#!/usr/bin/env bash
# In-flight weight updates under stress: run the asynchronous recipe N times with
# scheduler.weight_update_mode=in_flight (real torchrun, Megatron-core, SGLang on CPU) and count
# failures; then one run each of in_flight and wait with the same knobs, step times side by side.
# Needs the quick start's model and data (bash scripts/quickstart.sh once). Knobs:
#   RUNS   how many in-flight runs [20]
#   STEPS  steps per run [12]
#   OUT    where runs and logs go [runs/inflight-stress]
# Prints one line per run and `RESULT runs=N failures=F ...` at the end; exit 1 on any failure.
set -uo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
runs=${RUNS:-20}
steps=${STEPS:-12}
out=${OUT:-runs/inflight-stress}
py=.venv/bin/python
recipe=yaml_configs/tiny-grpo-async-cpu.yaml
[[ -f runs/tiny-llama-warm/config.json ]] || { echo "run bash scripts/quickstart.sh first" >&2; exit 2; }
mkdir -p "$out"

run() {  # run NAME MODE: one run of the recipe; prints its exit code
    local name=$1 mode=$2
    NPROC_PER_NODE=2 bash launch/torchrun.sh "$recipe" --run-dir "$out/$name" \
        --set trainer.num_steps="$steps" --set scheduler.weight_update_mode="$mode" \
        --set scheduler.generate_ahead_steps=1 --set rollout.max_new_tokens=48 \
        --set scheduler.validation_every=0 >"$out/$name.log" 2>&1
    echo $?
}

step_times() {  # step_times RUN_DIR: mean step_s, stall_s, lag and mixed samples of steps 2..
    "$py" - "$1/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])][2:]
mean = lambda key: sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)
print(f"step_s={mean('timing/step_s'):.3f} stall_s={mean('weight_sync/stall_s'):.3f} "
      f"lag_mean={mean('policy_lag/mean'):.3f} mixed_samples={mean('policy_lag/mixed_samples'):.1f}")
EOF
}

failures=0
for i in $(seq 1 "$runs"); do
    rc=$(run "inflight-$i" in_flight)
    [[ $rc == 0 ]] || failures=$((failures + 1))
    echo "run $i/$runs: exit $rc $( [[ $rc == 0 ]] && step_times "$out/inflight-$i" )"
done
echo "side by side (same knobs, one run each):"
for mode in in_flight wait; do
    rc=$(run "compare-$mode" "$mode")
    echo "  $mode: exit $rc $( [[ $rc == 0 ]] && step_times "$out/compare-$mode" )"
done
echo "RESULT runs=$runs failures=$failures"
[[ $failures == 0 ]]
