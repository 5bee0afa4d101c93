"""Malformed bytes to every service a broker serves, health and reflection included, on both ports:
INVALID_ARGUMENT, no traceback in the broker's log, and one log line per kind and peer however many come."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.support.brokers import close_broker, open_broker
from tests.support.helpers import until

pytestmark = pytest.mark.integration

GARBAGE = [b"\xff", b"\x0a\x05ab", b"\x08\xff\xff", b"\x0f", b"\x12\xff\xff\xff\xff\x0f"]
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
async def broker():
    b = await open_broker("malformed", "nixl")
    yield b
    assert await close_broker(b) == 0


async def unary(channel, method: str, data: bytes) -> grpc.StatusCode:
    try:
        await channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def server_streaming(channel, method: str, data: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(data, timeout=10)
    try:
        await call.read()
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()


async def bidi(channel, method: str, data: bytes) -> grpc.StatusCode:
    call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(timeout=10)
    try:
        await call.write(data)
        await call.done_writing()
        await call.read()
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()


@pytest.mark.parametrize("port", ["local", "peer"])
@pytest.mark.parametrize("method", [HEALTH_CHECK, HEALTH_WATCH, REFLECTION])
async def test_malformed_bytes_to_health_and_reflection_are_invalid_argument_without_a_traceback(
        broker, port, method):
    address = broker.process.listen if port == "local" else broker.peer_address
    send = {HEALTH_CHECK: unary, HEALTH_WATCH: server_streaming, REFLECTION: bidi}[method]
    async with grpc.aio.insecure_channel(address) as channel:
        codes = {await send(channel, method, data) for data in GARBAGE}
        assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
        healthy = await unary(channel, HEALTH_CHECK, health_pb2.HealthCheckRequest().SerializeToString())
        assert healthy is grpc.StatusCode.OK
    log = "\n".join(broker.process.stderr_lines)
    assert "Traceback" not in log and '"level": "error"' not in log, log[-3000:]


async def test_repeated_bad_input_logs_one_line_per_kind_and_peer():
    broker = await open_broker("malformed-lines", "nixl")  # one that has logged no refusal yet
    try:
        await flood_and_count(broker)
    finally:
        assert await close_broker(broker) == 0


async def flood_and_count(broker) -> None:
    before = len(broker.process.stderr_lines)
    async with grpc.aio.insecure_channel(broker.peer_address) as channel:
        codes = await asyncio.gather(*(unary(channel, HEALTH_CHECK, b"\xff") for _ in range(100)))
        assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
        # Another kind of refusal logs a line of its own: once it is read, so are the lines before it.
        assert await unary(channel, HEALTH_CHECK, b"\x00" * (1 << 17)) is grpc.StatusCode.RESOURCE_EXHAUSTED
    lines = broker.process.stderr_lines
    assert await until(lambda: any("bytes exceed" in line for line in lines[before:]), timeout=10)
    malformed = [line for line in lines[before:] if "not a valid message" in line]
    assert 1 <= len(malformed) <= 2, malformed  # 2: the interval may turn over once while the 100 run

