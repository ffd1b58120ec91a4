#!/usr/bin/env bash
# Create (or update) the virtual environment .venv in the checkout with everything a CPU run and
# the test suite need. Idempotent: a second run only checks. Knobs:
#   PYTHON   interpreter that creates the venv [python3]
#   VENV     where [<repo>/.venv]
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$repo_dir/.venv}
python=${PYTHON:-python3}

if [[ ! -x $venv/bin/python ]]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp=$venv/.megatron_async_rl.stamp
constraints=$repo_dir/constraints/cpu.txt
want=$(cat "$repo_dir/setup.py" "$constraints" "$0" | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    install_project=1
else
    install_project=0
fi
if ((install_project)); then
    # torch first, at the constraints' version: this machine's CPU wheel. Asking for a newer torch
    # would pull the CUDA build (several GB); with it installed, "torch>=2.6" installs nothing more.
    "${pip[@]}" install -c "$constraints" torch
    "${pip[@]}" install -c "$constraints" -e "$repo_dir[test]"
    echo "$want" >"$stamp"
fi
# The generation engine. On a CPU-only machine: the real SGLang without its CUDA wheels (its own
# idempotent script). On a GPU machine install sglang the ordinary way (pip install sglang).
if ! command -v nvidia-smi >/dev/null 2>&1 || [[ ${MEGATRON_ASYNC_RL_CPU_SGLANG:-0} == 1 ]]; then
    bash "$repo_dir/scripts/install_sglang_cpu.sh" "$venv"
fi
# The sandbox of the built-in `python` and `bash` tools (megatron_async_rl/sandbox): bubblewrap.
if ! command -v bwrap >/dev/null 2>&1; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 &&
                apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1; } ||
            echo "setup_env.sh: could not install bubblewrap: the python/bash tools' sandbox" \
                "and its tests need it (apt-get install bubblewrap)" >&2
    else
        echo "setup_env.sh: bubblewrap (bwrap) is missing: the python/bash tools' sandbox and" \
            "its tests need it (sudo apt-get install bubblewrap)" >&2
    fi
fi
