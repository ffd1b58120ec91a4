#!/usr/bin/env bash
# Install what the tests need and run the CPU test suite on both ends of the supported
# megatron-core range:
#   1. the whole suite in .venv (scripts/setup_env.sh: megatron-core as constraints/cpu.txt pins it,
#      the low end);
#   2. the tests that exercise megatron-core (the compatibility patches, the Megatron flags, the
#      distributed role tests, MTP, the main job end to end, the asynchronous job, checkpoint
#      resume) in .venv-megatron-core-$MEGATRON_CORE_HIGH (scripts/setup_megatron_core_env.sh:
#      the same environment with the high end's megatron-core).
# Extra arguments go to pytest, in both runs (e.g. -x, -k EXPR); HIGH_END=0 skips the second run.
# pytest's exit code 5 (no test collected) fails like any error.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
high=${MEGATRON_CORE_HIGH:-0.19.2}
bash scripts/setup_env.sh
[[ ${HIGH_END:-1} == 0 ]] || bash scripts/setup_megatron_core_env.sh "$high"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

low=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('megatron-core'))")
echo "== the whole suite, megatron-core $low (.venv)"
.venv/bin/python -m pytest "$@"
[[ ${HIGH_END:-1} == 0 ]] && exit 0

echo "== the tests that exercise megatron-core, megatron-core $high (.venv-megatron-core-$high)"
# The engine-only distributed files (SGLang, no Megatron role) are the same in both runs.
exec ".venv-megatron-core-$high/bin/python" -m pytest \
    tests/unit/test_compat_versions.py tests/unit/test_megatron_fixes.py \
    tests/unit/test_megatron_lm_flags.py tests/unit/test_megatron_flags.py \
    tests/unit/test_megatron_lm_examples_by_release.py tests/unit/test_mtp_flags.py \
    tests/unit/test_cuda_graph_refusal.py tests/unit/test_batch_ramp.py \
    tests/unit/test_device_discipline.py tests/distributed \
    --ignore tests/distributed/test_sglang_engine.py \
    --ignore tests/distributed/test_engine_restart.py \
    --ignore tests/distributed/test_reshard_sglang.py \
    --ignore tests/distributed/test_reshard_engine_tp2.py \
    --ignore tests/distributed/test_collective_faults.py \
    --ignore tests/distributed/test_engine_groups.py \
    tests/e2e/test_grpo_job.py tests/e2e/test_async_job.py tests/e2e/test_checkpoint_resume.py \
    "$@"
