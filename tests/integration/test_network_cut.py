"""The link between two brokers goes down mid-transfer: the same outcome as a kill, bounded in time.

Each broker runs in a network namespace of its own, joined by a veth pair (198.18.0.0/24, the
benchmarking range, on hosts this test creates); the test reaches their local APIs over Unix
sockets, which no network namespace hides.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools.launch import start_broker
from tests.support.brokers import Broker, close_broker
from tests.support.flows import MEDIUM, grant, until_state
from tests.support.flows import transfer_call as transfer

pytestmark = pytest.mark.integration

# A new network namespace, and a mount namespace to remount /sys in: UCX finds devices through sysfs.
# `echo` says the namespace exists (unshare has run, then exec'd sh): a gate acting on the pid before
# that moved the veth end into the parent's namespace, then looked for it in the new, empty one.
NETNS_WRAPPER = ["unshare", "-n", "-m", "sh", "-c",
                 'echo unshared && read go && mount -t sysfs none /sys && ip link set lo up && exec "$@"', "sh"]
TRANSFER_TIMEOUT_S = 6


async def sh(*command: str) -> None:
    proc = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, f"{' '.join(command)}: {err.decode()}"


async def netns_broker(name: str, backend: str, address: str, device: str, sockdir,
                       wired: asyncio.Barrier) -> Broker:
    """A broker alone in a new namespace with one veth end; it starts once both ends are up."""

    async def wire(pid: int) -> None:
        await sh("ip", "link", "set", device, "netns", str(pid))
        # IPv4 only: a tentative IPv6 link-local address makes UCX call its own endpoint unreachable
        await sh("nsenter", "-t", str(pid), "-n", "sysctl", "-q", "-w", f"net.ipv6.conf.{device}.disable_ipv6=1")
        await sh("nsenter", "-t", str(pid), "-n", "ip", "addr", "add", f"{address}/24", "dev", device)
        await sh("nsenter", "-t", str(pid), "-n", "ip", "link", "set", device, "up")
        await asyncio.wait_for(wired.wait(), 30)  # UCX needs a carrier, so both ends up, at start

    process = await start_broker(
        name, "--backend", backend, "--log-level", "WARNING", "--listen", f"unix:{sockdir}/{name}.sock",
        "--peer-listen", f"{address}:0", "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S),
        "--peer-rpc-timeout-s", "2", env={"UCX_NET_DEVICES": device}, prefix=NETNS_WRAPPER, gate=wire)
    channel = grpc.aio.insecure_channel(process.listen)
    return Broker(process, channel, bpb_grpc.BrokerServiceStub(channel))


@pytest.fixture
async def linked(backend, tmp_path):
    await sh("ip", "link", "add", "kvbA", "type", "veth", "peer", "name", "kvbB")
    made = []
    wired = asyncio.Barrier(2)
    try:
        made = list(await asyncio.gather(
            netns_broker("cut-prefill", backend, "198.18.0.1", "kvbA", tmp_path, wired),
            netns_broker("cut-decode", backend, "198.18.0.2", "kvbB", tmp_path, wired)))
        yield made
    finally:
        for broker in made:
            broker.process.kill()
            await close_broker(broker)
        proc = await asyncio.create_subprocess_exec("ip", "link", "del", "kvbA", stderr=asyncio.subprocess.DEVNULL)
        await proc.wait()  # gone already when its namespace died


async def test_link_down_mid_transfer_fails_both_sides_within_the_timeouts(linked, engines, request_id):
    prefill, decode = linked
    src = await engines.make(prefill, "prefill", MEDIUM)
    dst = await engines.make(decode, "decode", MEDIUM, fill="canary")
    ids = np.arange(MEDIUM.request_pages)
    await grant(dst, request_id, ids, expiry_ms=8000)
    sending = asyncio.ensure_future(transfer(src, dst, request_id, ids, timeout=60))
    await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
    await sh("nsenter", "-t", str(prefill.process.pid), "-n", "ip", "link", "set", "kvbA", "down")
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(sending, 60)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), info.value.details()
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S + 10  # the write's bound plus one peer call
    final = await until_state(dst, request_id, pb.TRANSFER_STATE_FAILED, timeout=30)
    assert final[-1].state == pb.TRANSFER_STATE_FAILED, final[-1]
