"""The health listener (`health_listen`, kvbroker/ops/health_listener.py) on real brokers: grpc.health.v1
Check for the whole server and both services, SERVING once started, NOT_SERVING for the whole drain
after SIGTERM (while the local API's health says the same), Watch refused with a message naming
where it is served, and the probe (`python -m kvbroker.ops.probe`) asking it by default when the
setting is given. That it answers under a flooded peer port is test_health_under_flood.py's."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import close_brokers, open_broker
from tests.support.flows import MAIN, offer, part, watch_first

pytestmark = pytest.mark.integration

SERVICES = ("", "kvbroker.v1.BrokerService", "kvbroker.v1.PeerService")


async def check(address: str, service: str = "") -> str:
    """The status name, or the error's code."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                  timeout=10)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


async def test_the_health_listener_serves_check_for_the_server_and_both_services(tmp_path):
    broker = await open_broker("health-listener", "nixl", "--health-listen", "127.0.0.1:0")
    socket_broker = await open_broker("health-socket", "nixl", "--health-listen", f"unix:{tmp_path}/h/health.sock")
    try:
        address = broker.process.health_listen
        assert address.startswith("127.0.0.1:") and not address.endswith(":0"), address
        assert [await check(address, service) for service in SERVICES] == ["SERVING"] * 3
        assert await check(address, "kvbroker.v1.Nothing") == "NOT_FOUND"
        assert socket_broker.process.health_listen == f"unix:{tmp_path}/h/health.sock"
        assert await check(socket_broker.process.health_listen) == "SERVING"
        assert os.stat(tmp_path / "h" / "health.sock").st_mode & 0o777 == 0o660  # as the local API's socket
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await watch.read()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "Check only" in info.value.details() and "local API" in info.value.details()
    finally:
        assert await close_brokers(broker, socket_broker) == [0, 0]
    assert not (tmp_path / "h" / "health.sock").exists()  # removed on shutdown, as the local API's


async def test_the_probe_asks_the_health_listener_when_it_is_configured():
    broker = await open_broker("health-probe", "nixl", "--health-listen", "127.0.0.1:0")
    try:
        env = {**os.environ, "KVBROKER_HEALTH_LISTEN": broker.process.health_listen,
               "KVBROKER_LISTEN": "unix:/nonexistent/kvbroker.sock"}  # not asked: health_listen is given
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvbroker.ops.probe", "--service", "kvbroker.v1.BrokerService", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(process.communicate(), 60)
        assert (process.returncode, out.decode().strip()) == (0, "SERVING")
    finally:
        assert await close_brokers(broker) == [0]


async def test_the_health_listener_says_not_serving_for_the_whole_drain(engines, request_id):
    """A decode broker holding a grant half written (one part of two landed) drains on SIGTERM for
    its grace period: meanwhile its health listener answers NOT_SERVING, as its local API does."""
    prefill = await open_broker("drain-prefill", "nixl")
    decode = await open_broker("drain-decode", "nixl", "--health-listen", "127.0.0.1:0", "--shutdown-grace-s", "600")
    try:
        src = await engines.make(prefill, "prefill", seed=45)
        dst = await engines.make(decode, "decode", fill="canary")
        await offer(dst, src, request_id, {MAIN: [5, 6]}, timeout=60)
        first = await part(src, request_id, {MAIN: [2]}, last=False)
        assert first.status.state == pb.TRANSFER_STATE_TRANSFERRING, first.status
        assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_TRANSFERRING
        address = decode.process.health_listen
        assert await check(address) == "SERVING"
        decode.process.process.send_signal(signal.SIGTERM)
        checks = 0
        while (status := await check(address, "kvbroker.v1.BrokerService")) == "SERVING":  # until the signal lands
            checks += 1
            assert checks < 1000, "still SERVING after SIGTERM"
        assert status == "NOT_SERVING"
        assert await check(decode.process.listen) == "NOT_SERVING"
        assert [await check(address, service) for service in SERVICES] == ["NOT_SERVING"] * 3
        last = await part(src, request_id, {MAIN: [3]}, offsets={MAIN: 1})  # the grant ends: so does the drain
        assert last.status.state == pb.TRANSFER_STATE_SUCCEEDED, last.status
        assert await asyncio.wait_for(decode.process.process.wait(), 60) == 0
    finally:
        assert await close_brokers(prefill, decode) == [0, 0]


async def test_the_loops_beat_keeps_a_short_stall_window_serving():
    """server.py beats the listener from the loop every health_beat_s: with a stall window of 0.5 s the
    listener still answers SERVING long after it (without the beat it turns NOT_SERVING for good once
    0.5 s have passed; the stalled answer itself is tests/unit/test_health_listener.py's)."""
    broker = await open_broker("health-beat", "nixl", "--health-listen", "127.0.0.1:0",
                               "--health-beat-s", "0.05", "--health-stall-s", "0.5")
    try:
        address = broker.process.health_listen
        await asyncio.sleep(2.0)  # not a synchronisation: four stall windows must pass for the beat to matter
        answers = []
        for _ in range(100):  # a loop delayed past 0.5 s on a loaded machine answers NOT_SERVING meanwhile
            answers.append(await check(address, "kvbroker.v1.BrokerService"))
            if answers[-1] == "SERVING":
                break
            await asyncio.sleep(0.1)
        assert answers[-1] == "SERVING", answers
    finally:
        assert await close_brokers(broker) == [0]
