#!/usr/bin/env bash
# Install the real SGLang into a CPU venv without pulling any CUDA wheel.
#
#   scripts/install_sglang_cpu.sh [VENV]      VENV defaults to <repo>/.venv
#
# Versions: sglang, torch, transformers and tokenizers are the ones constraints/cpu.txt names (the
# one list of exact versions; this script reads them there and installs with it as `-c`). SGLang
# 0.5.22+ pins torch 2.14.1, whose PyPI wheel is the CUDA build; here it runs on the CPU torch
# 2.13.0 (measured with 0.5.23: engine, weight sync, TP=2), with the transformers and tokenizers
# it pins.
#
# Why by hand: sglang's Requires-Dist pins CUDA-only kernels (sglang-kernel, flashinfer, ...),
# torch 2.14.1 and torchvision/torchaudio, whose PyPI wheels link the CUDA torch and break the
# CPU one. So sglang goes in with --no-deps and then the dependency list below, which is its
# Requires-Dist minus those; a check after the install fails if the installed sglang asks for a
# package this list neither installs nor skips (a new release needs the list reviewed).
# The CPU engine also needs two import shims, which live in megatron_async_rl/engines/sglang/cpu_shims
# and are put on the engine's PYTHONPATH at run time (see the README there); nothing is patched
# in the venv. Idempotent: a second run with the same script and pins only checks a stamp.
# pip reports dependency conflicts for the excluded packages (expected: filtered below to one
# line); don't run pip check.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-${VENV:-$repo_dir/.venv}}
py=$venv/bin/python
constraints=$repo_dir/constraints/cpu.txt
if [[ ! -x $py ]]; then
    echo "install_sglang_cpu.sh: no python at $py; run scripts/setup_env.sh first" >&2
    exit 1
fi
pip=("$py" -m pip --disable-pip-version-check -q)

# "name==version" lines of the constraints file, for the four packages this script answers for.
pins=()
for name in sglang torch transformers tokenizers; do
    line=$(grep -E "^$name==[^ ]+$" "$constraints" || true)
    if [[ -z $line ]]; then
        echo "install_sglang_cpu.sh: $constraints has no '$name==<version>' line" >&2
        exit 1
    fi
    pins+=("$line")
done
sglang_version=${pins[0]#sglang==}

stamp=$venv/.sglang_cpu.stamp
want=$( (cat "$0" && printf '%s\n' "${pins[@]}") | sha256sum | cut -d' ' -f1)
installed=$("$py" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)
if [[ -f $stamp && $(cat "$stamp") == "$want" && $installed == "$sglang_version" ]]; then
    exit 0
fi

# sglang 0.5.23's Requires-Dist for linux x86_64, python 3.11, without:
#   CUDA-only: sglang-kernel, flashinfer_python, flash-attn-4, cuda-python, nvidia-cutlass-dsl,
#     nvidia-mathdx, nvshmem4py-cu13, sgl-deep-ep, sgl-deep-gemm, sgl-flash-mla (CUDA binaries,
#     and it requires torch>=2.14.1), quack-kernels, tilelang, humming-kernels,
#     torch_memory_saver;
#   CUDA-linked on PyPI: torchvision, torchaudio, torchcodec (a stub stands in, see cpu_shims);
#   timm, which requires torchvision: installed below with --no-deps (only vision models use it);
#   torch, transformers, tokenizers: at the constraints' versions, through `-c`.
# deepseek-recipe and tml-renderers (chat renderers SGLang imports when serving those formats)
# are CPU wheels without dependencies: installed.
skipped=(
    sglang-kernel flashinfer-python flash-attn-4 cuda-python nvidia-cutlass-dsl nvidia-mathdx
    nvshmem4py-cu13 sgl-deep-ep sgl-deep-gemm sgl-flash-mla quack-kernels tilelang
    humming-kernels torch-memory-saver torchvision torchaudio torchcodec
)
timm=timm==1.0.25
deps=(
    aiohttp "anthropic>=0.20.0" apache-tvm-ffi==0.1.11 blobfile==3.0.0 build
    compressed-tensors==0.18.0 datasets deepseek-recipe==0.2.0 distro easydict einops fastapi
    gguf interegular IPython "kernels>=0.14.1,<0.15" "llguidance>=1.7.6,<2.0.0"
    "mistral_common>=1.11.5" modelscope msgspec ninja numba==0.65.1 numpy nvidia-ml-py
    openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser
    pillow "prometheus-client>=0.20.0" psutil py-spy pybase64 pydantic "python-dateutil<3"
    python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle
    "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 tiktoken tml-renderers==0.1.0 tqdm
    "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard
    # imported by sglang but not declared
    dill
    # sglang imports triton at module level; it installs and imports without a GPU
    triton
)

# pip's resolver lists every CUDA-only requirement skipped above as an ERROR block: expected, so
# it is replaced by one line saying so (anything else pip says on stderr is shown as it is).
quiet_resolver() {
    grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "^sglang [0-9.]* requires .*, which is not installed\.$" \
        -e "^sglang [0-9.]* requires .*, but you have .* which is incompatible\.$" >&2 || true
}

start=$SECONDS
echo "installing SGLang $sglang_version for CPU on ${pins[1]}: its CUDA-only requirements" \
    "(sglang-kernel, flashinfer, deep-ep, ...), CUDA-linked torchvision/torchaudio and its" \
    "CUDA torch pin are skipped on purpose"
"${pip[@]}" install -c "$constraints" torch
"${pip[@]}" install --no-deps -c "$constraints" sglang 2> >(quiet_resolver)
"${pip[@]}" install -c "$constraints" transformers tokenizers "${deps[@]}" 2> >(quiet_resolver)
"${pip[@]}" install --no-deps "$timm" 2> >(quiet_resolver)

# Fail here, not in the first engine start, if a CUDA-linked wheel slipped in.
for forbidden in torchvision torchaudio torchcodec sglang-kernel flashinfer-python; do
    if "$py" -m pip show -q "$forbidden" >/dev/null 2>&1; then
        echo "install_sglang_cpu.sh: $forbidden got installed; it breaks the CPU torch" >&2
        exit 1
    fi
done
# The pins hold, and every requirement of the installed sglang is installed here or skipped above.
"$py" - "${pins[@]}" -- "${skipped[@]}" -- "$timm" "${deps[@]}" <<'EOF'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

args = sys.argv[1:]
first, second = args.index("--"), len(args) - 1 - args[::-1].index("--")
pins, skipped, listed = args[:first], args[first + 1 : second], args[second + 1 :]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


want = dict(pin.split("==") for pin in pins)
got = {name: md.version(name) for name in want}
bad = {k: v for k, v in got.items() if v.split("+")[0] != want[k]}
if bad:
    raise SystemExit(f"install_sglang_cpu.sh: versions moved: {bad}, want {want}")
known = {norm(n) for n in want} | {norm(n) for n in skipped}
known |= {norm(Requirement(d).name) for d in listed}
unknown = sorted(
    req.name
    for req in map(Requirement, md.requires("sglang") or [])
    if (req.marker is None or req.marker.evaluate({"extra": ""})) and norm(req.name) not in known
)
if unknown:
    raise SystemExit(
        f"install_sglang_cpu.sh: sglang {got['sglang']} requires {unknown}, which this script "
        "neither installs nor skips: review its dependency list for this release"
    )
EOF
# The engine's own import, with the CPU shims as the engine host sets them up (~15 s).
if ! SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$repo_dir/megatron_async_rl/engines/sglang/cpu_shims" \
    "$py" -W ignore -c "import sglang.srt.entrypoints.engine" >/dev/null; then
    echo "install_sglang_cpu.sh: sglang does not import with the CPU shims (see above)" >&2
    exit 1
fi
echo "install_sglang_cpu.sh: sglang $sglang_version installed in $((SECONDS - start)) s" >&2
echo "$want" >"$stamp"
