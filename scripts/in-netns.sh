#!/usr/bin/env bash
# Runs a command in a private network namespace that has only loopback: NIXL's UCX and Mooncake
# listen on all interfaces, so brokers started by the demo and the tests must see no other one.
set -euo pipefail
if [[ $(id -u) -ne 0 ]]; then
    echo "in-netns: creating a network namespace needs root (unshare -n)" >&2
    exit 1
fi
exec unshare -n -- sh -c 'ip link set lo up && exec env UCX_NET_DEVICES=lo "$@"' sh "$@"
