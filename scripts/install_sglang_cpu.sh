#!/usr/bin/env bash
# Install the real SGLang (0.5.21) into a CPU venv without pulling any CUDA wheel.
#
#   scripts/install_sglang_cpu.sh [VENV]      VENV defaults to <repo>/.venv
#
# Why by hand: sglang's Requires-Dist pins CUDA-only kernels (sglang-kernel, flashinfer, ...) and
# torchvision/torchaudio, whose PyPI wheels link the CUDA torch and break the CPU one. So sglang
# goes in with --no-deps and then its dependency list minus those; torch, transformers and
# tokenizers stay exactly as the project pins them (sglang 0.5.21 pins the same versions).
# The CPU engine also needs two import shims, which live in megatron_async_rl/engines/cpu_shims
# and are put on the engine's PYTHONPATH at run time (see the README there); nothing is patched
# in the venv. Idempotent: a second run with the same script only checks a stamp.
# pip reports dependency conflicts for the excluded packages (expected: filtered below to one
# line); don't run pip check.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-${VENV:-$repo_dir/.venv}}
py=$venv/bin/python
if [[ ! -x $py ]]; then
    echo "install_sglang_cpu.sh: no python at $py; run scripts/setup_env.sh first" >&2
    exit 1
fi
pip=("$py" -m pip --disable-pip-version-check -q)
stamp=$venv/.sglang_cpu.stamp
want=$(sha256sum "$0" | cut -d' ' -f1)
sglang_version=0.5.21
installed=$("$py" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)
if [[ -f $stamp && $(cat "$stamp") == "$want" && $installed == "$sglang_version" ]]; then
    exit 0
fi

# The project's pins; sglang 0.5.21 asks for exactly these, and a constraint keeps any other
# dependency from moving them.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
cat >"$constraints" <<'EOF'
torch==2.13.0
transformers==5.12.1
tokenizers==0.22.2
EOF

# sglang's Requires-Dist for linux x86_64, python 3.11, without:
#   CUDA-only: sglang-kernel, flashinfer_python, flash-attn-4, cuda-python, cuda-tile,
#     nvidia-cutlass-dsl, nvidia-mathdx, nvshmem4py-cu13, sgl-deep-ep, sgl-deep-gemm,
#     quack-kernels, tilelang, humming-kernels, tokenspeed_mla, torch_memory_saver;
#   CUDA-linked on PyPI: torchvision, torchaudio, torchcodec (a stub stands in, see cpu_shims);
#   timm, which requires torchvision: installed below with --no-deps (only vision models use it);
#   the pins above, already installed.
deps=(
    aiohttp "anthropic>=0.20.0" apache-tvm-ffi==0.1.11 blobfile==3.0.0 build
    compressed-tensors==0.18.0 datasets distro easydict einops fastapi gguf interegular
    IPython "kernels>=0.14.1,<0.15" "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5"
    modelscope msgspec ninja numba==0.65.1 numpy nvidia-ml-py openai==2.6.1
    openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow
    "prometheus-client>=0.20.0" psutil py-spy pybase64 pydantic python-multipart
    "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle
    "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 tiktoken tqdm uvicorn uvloop watchfiles
    xgrammar==0.2.7 xxhash zstandard
    # imported by sglang but not declared
    dill
    # sglang imports triton at module level; it installs and imports without a GPU
    triton
)

# pip's resolver lists every CUDA-only requirement skipped above as an ERROR block: expected, so
# it is replaced by one line saying so (anything else pip says on stderr is shown as it is).
quiet_resolver() {
    grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "^sglang [0-9.]* requires .*, which is not installed\.$" >&2 || true
}

start=$SECONDS
echo "installing SGLang $sglang_version for CPU: its CUDA-only requirements (sglang-kernel," \
    "flashinfer, deep-ep, ...) and CUDA-linked torchvision/torchaudio are skipped on purpose"
"${pip[@]}" install --no-deps "sglang==$sglang_version" 2> >(quiet_resolver)
"${pip[@]}" install -c "$constraints" "${deps[@]}" 2> >(quiet_resolver)
"${pip[@]}" install --no-deps timm==1.0.16 2> >(quiet_resolver)

# Fail here, not in the first engine start, if a CUDA-linked wheel slipped in.
for forbidden in torchvision torchaudio torchcodec sglang-kernel flashinfer-python; do
    if "$py" -m pip show -q "$forbidden" >/dev/null 2>&1; then
        echo "install_sglang_cpu.sh: $forbidden got installed; it breaks the CPU torch" >&2
        exit 1
    fi
done
"$py" - <<'EOF'
import importlib.metadata as md

got = {name: md.version(name) for name in ("sglang", "torch", "transformers", "tokenizers")}
want = {"sglang": "0.5.21", "torch": "2.13.0", "transformers": "5.12.1", "tokenizers": "0.22.2"}
bad = {k: v for k, v in got.items() if not v.startswith(want[k])}
if bad:
    raise SystemExit(f"install_sglang_cpu.sh: versions moved: {bad}, want {want}")
EOF
# The engine's own import, with the CPU shims as the engine host sets them up (~15 s).
if ! SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$repo_dir/megatron_async_rl/engines/cpu_shims" \
    "$py" -W ignore -c "import sglang.srt.entrypoints.engine" >/dev/null; then
    echo "install_sglang_cpu.sh: sglang does not import with the CPU shims (see above)" >&2
    exit 1
fi
echo "install_sglang_cpu.sh: sglang $sglang_version installed in $((SECONDS - start)) s" >&2
echo "$want" >"$stamp"
