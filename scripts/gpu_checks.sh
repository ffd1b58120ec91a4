#!/usr/bin/env bash
# The GPU checks, in one command, for a lent CUDA machine (one GPU, torch with CUDA, no SGLang,
# no network). Run from the repository root:
#
#     bash scripts/gpu_checks.sh [tests] [cpu] [bench] [engine]   # all by default; logs under $OUT
#
# What the machine lacks travels in .whl/ (git-ignored): `bash scripts/gpu_bundle.sh` writes
# .whl/site.tar.xz (SGLang, what its engine imports that the image lacks, megatron-core 0.19.2,
# transformers and tokenizers; computed, checked against the 64 MiB carry limit), unpacked into
# /tmp/site here. Loose wheels in .whl/ are installed too, e.g. megatron-core at the high end of
# the supported range (0.19.x: the GPU machine has Python 3.12, which 0.17+ require) and the
# transformers/tokenizers pair of constraints/cpu.txt, fetched here with
#     pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#         megatron-core==0.19.2 transformers==<constraints> tokenizers==<constraints>
# They are installed into /tmp/site; MEGATRON_CORE_WANT (default 0.19.) is checked. What runs:
#   1. the GPU test suite, `pytest -m gpu tests/gpu` but the engine's (part 4): CUDA parity
#      fp32/bf16, PPO mini-batch steps fp32/bf16 and MoE, weight sync on CUDA, the pinned
#      staging arena, two NCCL ranks where there are two GPUs;
#   2. CPU tests on a GPU node (the CPU recipes must work where CUDA is visible): one-rank and
#      two-rank gloo parity and weight sync;
#   3. benchmarks/checkpoint.py on the GPU (issue 13's save-time and async-stall targets), at two
#      step sizes;
#   4. the engine on CUDA (issue 37; needs SGLang: .whl/site.tar.xz): tests/gpu/test_engine_cuda.py
#      (generate and log-probs against transformers, a weight update by CUDA IPC read back, kill
#      and restart, deterministic inference), then scripts/gpu_engine_checks.py (the quick start
#      on one GPU with two ranks, synchronous and one step ahead, 20 steps each, and a killed
#      and resumed run against an uninterrupted one).
# The last lines (and $OUT/summary.txt) say which parts ran, passed, failed or were skipped.
set -u
PARTS=${*:-tests cpu bench engine}
SUMMARY=()
note() {  # note PART STATUS: one line of the summary
    SUMMARY+=("$1: $2")
}
pytest_status() {  # pytest_status EXIT LOG: passed / FAILED / nothing ran, and pytest's counts
    local counts
    counts=$(grep -E '(passed|failed|skipped|error).* in [0-9.]+s' "$2" | tail -1)
    if [ "$1" != 0 ]; then echo "FAILED (exit $1); $counts"
    elif [[ "$counts" == *passed* ]]; then echo "passed; $counts"
    else echo "NOTHING RAN; $counts"; fi
}
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if [ -f .whl/site.tar.xz ]; then  # scripts/gpu_bundle.sh: SGLang and what it imports, unpacked
    mkdir -p /tmp/site && tar -xJf .whl/site.tar.xz -C /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, transformers, megatron.core as m; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'megatron-core', m.__version__)"
    python3 -c "import transformer_engine" 2>/dev/null && echo "transformer_engine: yes" \
        || echo "transformer_engine: not installed"
    python3 -c "import apex" 2>/dev/null && echo "apex: yes" || echo "apex: not installed"
    python3 -c "import sglang; print('sglang', sglang.__version__)" 2>/dev/null \
        || echo "sglang: not installed (bash scripts/gpu_bundle.sh carries it)"
} 2>&1 | tee "$OUT/machine.txt"
python3 -c "import sys, megatron.core as m; v = m.__version__; want = '${MEGATRON_CORE_WANT:-0.19.}'; \
sys.exit(0 if v.startswith(want) else f'megatron-core {v} installed, want {want}x: carry its wheel in .whl/')" \
    || exit 1

if [[ " $PARTS " == *" tests "* ]]; then
echo "== 1. pytest -m gpu tests/gpu"
# the engine's GPU tests are part 4's (with SGLang's check), not run twice
timeout 300 python3 -m pytest -m gpu tests/gpu --ignore tests/gpu/test_engine_cuda.py -q -s -rA \
    -p no:cacheprovider 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|^DEBUG" | tee "$OUT/pytest_gpu.log"
rc=${PIPESTATUS[0]}
echo "pytest gpu exit: $rc" | tee -a "$OUT/pytest_gpu.log"
note "1 tests/gpu" "$(pytest_status "$rc" "$OUT/pytest_gpu.log")"
else
note "1 tests/gpu" "not asked for"
fi

if [[ " $PARTS " == *" cpu "* ]]; then
echo "== 2. CPU tests on a GPU node"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x \
    tests/distributed/test_hf_parity.py tests/distributed/test_weight_sync_one_rank.py 2>&1 \
    | tail -15 | tee "$OUT/pytest_cpu_on_gpu_node.log"
rc=${PIPESTATUS[0]}
echo "pytest cpu exit: $rc" | tee -a "$OUT/pytest_cpu_on_gpu_node.log"
note "2 CPU tests on a GPU node" "$(pytest_status "$rc" "$OUT/pytest_cpu_on_gpu_node.log")"
else
note "2 CPU tests on a GPU node" "not asked for"
fi

if [[ " $PARTS " == *" bench "* ]]; then
echo "== 3. benchmarks/checkpoint.py on the GPU"
for shape in "8 1024" "64 1024"; do
    set -- $shape
    timeout 150 python3 benchmarks/checkpoint.py --device cuda --repeats 3 --batch "$1" \
        --seq-len "$2" --profile-stall 2>&1 | grep -v "UserWarning\|warnings.warn" \
        | grep -v "^DEBUG\|Writing model shards" | tee -a "$OUT/checkpoint_bench.log"
done
results=$(grep -c RESULT "$OUT/checkpoint_bench.log" 2>/dev/null)
note "3 checkpoint benchmark" "ran (${results:-0} RESULT lines)"
else
note "3 checkpoint benchmark" "not asked for"
fi

if [[ " $PARTS " == *" engine "* ]]; then
echo "== 4. the engine on CUDA"
if python3 -c "import sglang" 2>/dev/null; then
    python3 -c "import shutil; print('nvcc (SGLang JIT kernels):', shutil.which('nvcc') or 'absent')"
    timeout 480 python3 -m pytest -m gpu tests/gpu/test_engine_cuda.py -q -s -rA \
        -p no:cacheprovider 2>&1 | grep -v "UserWarning\|warnings.warn\|^DEBUG" \
        | tee "$OUT/engine_tests.log"
    rc=${PIPESTATUS[0]}
    note "4a engine tests on CUDA" "$(pytest_status "$rc" "$OUT/engine_tests.log")"
    timeout 1500 python3 scripts/gpu_engine_checks.py --out "$OUT/engine" --steps 20 2>&1 \
        | grep -v "UserWarning\|warnings.warn" | tee "$OUT/engine_checks.log"
    rc=${PIPESTATUS[0]}
    note "4b quick start on one GPU, resume" "$( [ "$rc" = 0 ] && echo passed || echo \
        "FAILED (exit $rc)" ); $(grep '^RESULT' "$OUT/engine_checks.log" | tail -1)"
else
    echo "skipped: SGLang is not importable (bash scripts/gpu_bundle.sh on the CPU machine \
writes .whl/site.tar.xz, carried with the tree)"
    note "4 engine on CUDA" "SKIPPED: no SGLang (carry .whl/site.tar.xz)"
fi
else
note "4 engine on CUDA" "not asked for"
fi

echo "== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
