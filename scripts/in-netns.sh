#!/usr/bin/env bash
# Runs a command in a private network namespace that has only loopback: NIXL's UCX and Mooncake
# listen on all interfaces, so brokers started by the demo and the tests must see no other one.
# It gets a private /dev/shm as well (a mount namespace with its own tmpfs, as large as the host's):
# whatever shared memory a crashed server leaves behind is gone when the command ends.
set -euo pipefail
if [[ $(id -u) -ne 0 ]]; then
    echo "in-netns: creating a network namespace needs root (unshare -n)" >&2
    exit 1
fi
shm_size=$(df --output=size -B1 /dev/shm 2>/dev/null | tail -n 1 || true)
export KVBROKER_SHM_SIZE=${shm_size:-50%}
exec unshare -n -m --propagation private -- sh -c '
    ip link set lo up &&
    mount -t tmpfs -o "size=$KVBROKER_SHM_SIZE,mode=1777,nosuid,nodev" kvbroker-shm /dev/shm &&
    exec env UCX_NET_DEVICES=lo "$@"' sh "$@"
