#!/usr/bin/env bash
# Check that installing this package into a user's existing environment moves none of their
# stack: a fresh venv gets torch, transformers, tokenizers and megatron-core at the versions a
# cluster user may have (defaults: the high end of the supported range), then
# `pip install <repo>` (not editable); the script fails if any of the four changed.
#
#   scripts/check_install_keeps_env.sh [VENV]        VENV defaults to a fresh temporary folder
#
# Knobs: MEGATRON_CORE [0.19.2], TRANSFORMERS [5.20.0], TOKENIZERS [0.23.2], TORCH [2.13.0: the
# CPU wheel this machine has; another version would download the multi-GB CUDA build].
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$(mktemp -d)/user-env}
python=${PYTHON:-python3}
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
ignore=()
if ! "$venv/bin/python" -c "import sys; sys.exit(sys.version_info < (3, 12))"; then
    ignore=(--ignore-requires-python)  # megatron-core 0.17+ declare Python >= 3.12
fi
# triton: megatron-core 0.19 imports it (transformer/moe/ops/paged_stash.py) without declaring
# it; a CUDA build of torch brings it, this machine's CPU build does not.
"${pip[@]}" install "torch==${TORCH:-2.13.0}" "transformers==${TRANSFORMERS:-5.20.0}" \
    "tokenizers==${TOKENIZERS:-0.23.2}" triton
"${pip[@]}" install "${ignore[@]}" "megatron-core==${MEGATRON_CORE:-0.19.2}"
stack() {
    "$venv/bin/python" -c "import importlib.metadata as m
for name in ('torch', 'triton', 'transformers', 'tokenizers', 'megatron-core'):
    print(name, m.version(name))"
}
before=$(stack)
# Without --ignore-requires-python here: it would also admit releases of our own dependencies
# that need a newer Python (pip checks an installed megatron-core's Requires-Python no more).
"${pip[@]}" install "$repo_dir"
after=$(stack)
echo "before: $(tr '\n' ' ' <<<"$before")"
echo "after:  $(tr '\n' ' ' <<<"$after")"
if [[ $before != "$after" ]]; then
    echo "check_install_keeps_env.sh: installing megatron_async_rl changed the user's stack" >&2
    exit 1
fi
"$venv/bin/python" -W ignore -c "import megatron_async_rl.train, megatron.core as m; print('imports with megatron-core', m.__version__)"
echo "check_install_keeps_env.sh: the user's stack is unchanged"
