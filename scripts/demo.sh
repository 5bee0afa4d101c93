#!/usr/bin/env bash
# Sets up kvbroker and runs `kvbroker demo`: a prefill and a decode broker, one MiniMax-M3-shaped
# request moved through NIXL and verified to the byte. Extra arguments go to the demo
# (e.g. --preset large, --backend mooncake).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec scripts/in-netns.sh .venv/bin/kvbroker demo "$@"
