#!/usr/bin/env bash
# The full benchmark (about thirteen minutes, up to ~2.5 GiB of shared memory at the 1 GiB size) in a
# loopback-only network namespace: table on the terminal, JSON in benchmarks/out/bench-<time>.json.
# Extra arguments go to `kvbroker bench` (e.g. --quick, --sections data, --sizes 64,256).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/out
exec scripts/in-netns.sh .venv/bin/kvbroker bench --out "benchmarks/out/bench-$(date -u +%Y%m%dT%H%M%SZ).json" "$@"
