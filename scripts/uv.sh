#!/usr/bin/env bash
# Runs uv, the installer that compiles and installs from locks/, bootstrapping it first into
# .tools/uv from locks/uv.txt (pip, hash-checked). torch's CPU build is not on PyPI: where this
# machine keeps it (/opt/wheels) uv looks there, elsewhere on PyPI's neighbour download.pytorch.org.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=.tools/uv/bin/uv
if [[ ! -x $uv ]] || ! cmp -s locks/uv.txt .tools/uv/.installed-from; then
    rm -rf .tools/uv
    python3 -m venv .tools/uv
    .tools/uv/bin/python -m pip install -q --require-hashes --no-deps -r locks/uv.txt
    cp locks/uv.txt .tools/uv/.installed-from
fi
if [[ -d /opt/wheels ]]; then
    export UV_FIND_LINKS=/opt/wheels
else
    export UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
fi
exec "$uv" "$@"
