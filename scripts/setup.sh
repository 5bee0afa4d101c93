#!/usr/bin/env bash
# Installs everything kvbroker needs on a fresh Debian machine with Python 3.11: the Debian
# library Mooncake's CPU build loads (libibverbs1), a virtualenv in .venv with the client packages
# (kvbroker_client, kvbroker_sglang), the daemon and both transfer engines (torch pinned to the
# CPU build), and, with --test, the test tools (pytest & co. from PyPI, buf from npm into .tools/) and
# SGLang 0.5.23 for tests/sglang: without its own requirements (they pin a CUDA torch), with the pinned
# list in constraints/sglang-cpu.txt of what its disaggregation modules import. Idempotent: a second
# run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

want_tests=0
[[ "${1:-}" == "--test" ]] && want_tests=1

if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: libibverbs1 is missing and installing it needs root (apt-get install libibverbs1)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
stamp=.venv/.kvbroker-installed
extras="nixl,mooncake-cpu"
(( want_tests )) && extras="$extras,test"
# sglang's own requirements pin torch 2.14.1 (CUDA) and GPU kernels; PyPI's torchvision is a CUDA build
# that cannot load its ops on CPU torch (tests/sglang/conftest.py says how the suite lives with that).
sglang_pins="sglang==0.5.23 torchvision==0.28.0"
inputs=$(cat pyproject.toml setup.py kvbroker/memory/_memguard.c clients/python/pyproject.toml clients/sglang/pyproject.toml \
    constraints/cpu.txt constraints/sglang-cpu.txt; echo "$extras $sglang_pins")
if [[ ! -f $stamp ]] || [[ "$(cat "$stamp")" != "$(sha256sum <<<"$inputs" | cut -d' ' -f1)" ]]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints/cpu.txt -e clients/python -e clients/sglang -e ".[$extras]"
    if (( want_tests )); then
        .venv/bin/python -m pip install -q -c constraints/cpu.txt -r constraints/sglang-cpu.txt
        # shellcheck disable=SC2086  # two requirement specifiers
        .venv/bin/python -m pip install -q --no-deps $sglang_pins
    fi
    sha256sum <<<"$inputs" | cut -d' ' -f1 >"$stamp"
fi

if (( want_tests )) && [[ ! -x .tools/node_modules/.bin/buf ]]; then
    mkdir -p .tools
    npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0 >/dev/null
fi
