#!/usr/bin/env bash
# Sets up kvbroker with its test tools from the locks, checks the locks against their inputs, builds the
# CPU image (scripts/image.sh: both need the package indexes), and runs the whole suite in a
# loopback-only network namespace. Extra arguments go to pytest. pytest's
# "no tests collected" (exit 5) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
scripts/lock.sh --check  # each lock is what its inputs compile to (asks the package index)
scripts/image.sh  # the CPU image tests/deploy/test_image.py runs (builds with PyPI; podman from Debian)
export PATH="$PWD/.venv/bin:$PATH"  # grpcurl, hadolint, kubectl and kvbroker come with the venv
set +e
scripts/in-netns.sh .venv/bin/python -m pytest -p no:cacheprovider "$@"
code=$?
set -e
if [[ $code -eq 5 ]]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit $code
