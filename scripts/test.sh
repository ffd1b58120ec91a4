#!/usr/bin/env bash
# Install what the tests need and run the CPU test suite on both ends of the supported
# megatron-core range:
#   1. the whole suite in .venv (scripts/setup_env.sh: megatron-core as constraints/cpu.txt pins it,
#      the low end);
#   2. the tests that exercise megatron-core (the compatibility patches, the Megatron flags, the
#      distributed role tests, MTP, the main job end to end, the asynchronous loop at N = 0 (on
#      two hosts), checkpoint resume) in .venv-megatron-core-$MEGATRON_CORE_HIGH
#      (scripts/setup_megatron_core_env.sh: the same environment with the high end's
#      megatron-core). Left to the low end: a rank-local error reported once and the four-window
#      run one step ahead (tests/e2e/test_async_job.py), which exercise this package's code,
#      not megatron-core's.
#   Without extra arguments, the longest tests that never import megatron-core (`engine_only`:
#   the SGLang engine's own distributed tests; `balanced_unit`: the math grader, the engine's
#   CPU kernels, the launch scripts, the code sandbox, the warm start) run once, in the second
#   run instead of the first, so that the two runs side by side end closer together (the
#   suite's wall time on 2 cores; the cores' total work bounds it).
# Extra arguments go to pytest, in both runs (e.g. -x, -k EXPR), and leave the first run the
# whole suite; HIGH_END=0 skips the second run.
# pytest's exit code 5 (no test collected) fails like any error.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_dir"
high=${MEGATRON_CORE_HIGH:-0.19.2}
bash scripts/setup_env.sh
[[ ${HIGH_END:-1} == 0 ]] || bash scripts/setup_megatron_core_env.sh "$high"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

low=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('megatron-core'))")
if [[ ${HIGH_END:-1} == 0 ]]; then
    echo "== the whole suite, megatron-core $low (.venv)"
    exec .venv/bin/python -m pytest "$@"
fi

# The engine-only distributed files (SGLang, no Megatron role): megatron-core is not in them.
engine_only=(
    tests/distributed/test_sglang_engine.py tests/distributed/test_engine_restart.py
    tests/distributed/test_reshard_sglang.py tests/distributed/test_reshard_engine_tp2.py
    tests/distributed/test_collective_faults.py tests/distributed/test_engine_groups.py
)
high_tests=(
    tests/unit/test_compat_versions.py tests/unit/test_megatron_fixes.py
    tests/unit/test_megatron_lm_flags.py tests/unit/test_megatron_flags.py
    tests/unit/test_megatron_lm_examples_by_release.py tests/unit/test_mtp_flags.py
    tests/unit/test_cuda_graph_refusal.py tests/unit/test_batch_ramp.py
    tests/unit/test_device_discipline.py tests/distributed
    tests/e2e/test_grpo_job.py tests/cluster/test_multihost.py tests/e2e/test_checkpoint_resume.py
    --deselect "tests/e2e/test_grpo_job.py::test_an_error_only_a_non_leader_rank_finds_is_printed_once"
)
# Run once, in the second run, when no extra argument is given (see the top).
balanced_unit=(tests/unit/test_math_grade.py tests/unit/test_kernel_free.py
               tests/unit/test_batched_attention.py tests/unit/test_launch_scripts.py
               tests/unit/test_sandbox.py tests/unit/test_warm_start.py)
low_args=("$@")
if (($# == 0)); then  # the second run's tests/distributed holds the engine-only files then
    low_args=("${engine_only[@]/#/--ignore=}" "${balanced_unit[@]/#/--ignore=}")
    high_tests+=("${balanced_unit[@]}")
else
    high_tests+=("${engine_only[@]/#/--ignore=}")
fi
high_run() {  # its own temporary root and no cache: it may run beside the other session
    PYTEST_DEBUG_TEMPROOT=$high_tmp ".venv-megatron-core-$high/bin/python" -m pytest \
        -p no:cacheprovider "${high_tests[@]}" "$@"
}
high_tmp=$(mktemp -d "${TMPDIR:-/tmp}/megatron-core-$high-tests.XXXXXX")

# The two runs share the 2 cores side by side unless TEST_SEQUENTIAL=1: a run keeps a core
# about a quarter idle (start-ups, waits on engines), and the second run takes it up.
if [[ ${TEST_SEQUENTIAL:-0} == 1 ]]; then
    echo "== the suite, megatron-core $low (.venv)"
    set +e
    .venv/bin/python -m pytest "${low_args[@]}"
    low_rc=$?
    echo "== the tests that exercise megatron-core (and those balanced), megatron-core $high (.venv-megatron-core-$high)"
    high_run "$@"
    high_rc=$?
else
    high_log=$high_tmp/pytest.log
    high_run "$@" >"$high_log" 2>&1 &
    high_pid=$!
    trap 'pkill -TERM -P "$high_pid" 2>/dev/null; kill "$high_pid" 2>/dev/null || true' INT TERM
    echo "== the suite, megatron-core $low (.venv); megatron-core $high beside it"
    set +e
    .venv/bin/python -m pytest "${low_args[@]}"
    low_rc=$?
    wait "$high_pid"
    high_rc=$?
    echo "== the tests that exercise megatron-core (and those balanced), megatron-core $high (.venv-megatron-core-$high)"
    cat "$high_log"
fi
rm -rf "$high_tmp"
echo "== megatron-core $low: exit $low_rc; megatron-core $high: exit $high_rc"
# pytest's 5 (no test collected) fails like any other non-zero code
((low_rc == 0 && high_rc == 0))
