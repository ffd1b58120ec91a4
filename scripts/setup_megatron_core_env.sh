#!/usr/bin/env bash
# A second environment with another megatron-core, layered over the main one (.venv).
#
#   scripts/setup_megatron_core_env.sh [VERSION]     VERSION defaults to the newest end tested
#
# Creates <repo>/.venv-megatron-core-VERSION: a venv whose own site-packages hold only that
# megatron-core, and which then reads the main venv's site-packages (torch, transformers, SGLang,
# this package, the test tools) through one .pth file. Its python therefore imports the other
# megatron-core and everything else exactly as .venv has it: the tests of the two ends differ in
# megatron-core alone. Run scripts/setup_env.sh first (scripts/test.sh does).
#
# megatron-core 0.17 and later declare Requires-Python >= 3.12. Their only compiled module (the
# pretraining dataset helpers, unused here) builds for Python 3.11 from the release's sdist, and
# nothing else they import needs 3.12; on 3.11 the sdist is installed with
# --ignore-requires-python (on 3.12 and later the ordinary wheel is used). Idempotent.
set -euo pipefail
repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=${1:-0.19.2}
[[ $version =~ ^0\.(1[6-9])\.[0-9]+$ ]] ||
    { echo "setup_megatron_core_env.sh: VERSION='$version' must be a megatron-core 0.16.x-0.19.x release (e.g. 0.19.2)" >&2; exit 2; }
main_py=${VENV:-$repo_dir/.venv}/bin/python
[[ -x $main_py ]] ||
    { echo "setup_megatron_core_env.sh: no main venv at $main_py; run scripts/setup_env.sh first" >&2; exit 1; }
venv=$repo_dir/.venv-megatron-core-$version
py=$venv/bin/python
main_site=$("$main_py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [[ ! -x $py ]]; then
    "$main_py" -m venv --without-pip "$venv"
fi
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir (not a bare path) so the main venv's own .pth files (the editable install) apply.
echo "import site; site.addsitedir('$main_site')" >"$site/zz_main_venv.pth"
installed=$("$py" -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || true)
if [[ $installed != "$version" || ! -d $site/megatron/core ]]; then
    start=$SECONDS
    pip=("$main_py" -m pip --disable-pip-version-check -q)
    ignore=()
    if ! "$main_py" -c "import sys; sys.exit(sys.version_info < (3, 12))"; then
        ignore=(--ignore-requires-python --no-binary megatron-core)
    fi
    rm -rf "$site/megatron" "$site"/megatron_core-*.dist-info
    "${pip[@]}" install --no-deps "${ignore[@]}" --target "$site" "megatron-core==$version"
    echo "setup_megatron_core_env.sh: megatron-core $version in $venv ($((SECONDS - start)) s)" >&2
fi
got=$("$py" -c "import megatron.core, importlib.metadata as m; print(m.version('megatron-core'))")
[[ $got == "$version" ]] ||
    { echo "setup_megatron_core_env.sh: $venv imports megatron-core $got, not $version" >&2; exit 1; }
