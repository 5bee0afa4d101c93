"""Sessions: engines registered under an OpenSession stream are unregistered when the stream ends,
however it ends (the server cancels it, or dies), and only those engines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import ALL, close_broker, open_broker

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def session(stub, holder: str = "test"):
    """An open session: its id, while the stream stays open; the stream is cancelled on exit."""
    call = stub.OpenSession(bpb.OpenSessionRequest(holder=holder))
    try:
        first = await asyncio.wait_for(call.read(), 10)
        yield first.session_id, call
    finally:
        call.cancel()


def mapped(pid: int, segment_name: str) -> bool:
    return f"/dev/shm/{segment_name}" in Path(f"/proc/{pid}/maps").read_text()


async def unmapped(pid: int, segment_name: str, timeout: float = 30.0) -> bool:
    """Whether the broker lets go of the segment within `timeout`. Its watchers hear that the engine
    was unregistered, and GetBrokerInfo stops listing it, before the engine's memory is deregistered
    and unmapped, which may take a while on a busy machine: nothing the test sees says when."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while mapped(pid, segment_name):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def grant_and_watch(engine, request_id: str):
    await engine.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=engine.engine_id, components=ALL, dst_page_ids=[1, 2, 3]), timeout=10)
    call = engine.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=engine.engine_id, request_id=request_id),
                                     timeout=30)
    first = await call.read()
    assert first.status.state == pb.TRANSFER_STATE_PENDING
    return call


async def final_status(call) -> pb.TransferStatus:
    last = None
    while (reply := await call.read()) is not grpc.aio.EOF:
        last = reply.status
    return last


async def test_ending_a_session_unregisters_its_engines_and_fails_their_grants(brokers, engines, request_id):
    broker = brokers.decode
    async with session(broker.stub, "decode-0 pid 1") as (session_id, call):
        held = await engines.make(broker, "decode", fill="canary", session_id=session_id)
        free = await engines.make(broker, "decode", fill="canary")
        info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
        ours = [s for s in info.sessions if s.session_id == session_id]
        assert len(ours) == 1 and list(ours[0].engine_ids) == [held.engine_id] and ours[0].holder == "decode-0 pid 1"
        assert {e.engine_id: e.session_id for e in info.engines}[held.engine_id] == session_id
        watch = await grant_and_watch(held, request_id)
        assert mapped(broker.process.pid, held.segment.name)
    status = await asyncio.wait_for(final_status(watch), 30)
    assert status.state == pb.TRANSFER_STATE_FAILED and status.code == grpc.StatusCode.ABORTED.value[0]
    assert "unregistered" in status.reason

    info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    registered = {e.engine_id for e in info.engines}
    assert held.engine_id not in registered and free.engine_id in registered
    assert session_id not in {s.session_id for s in info.sessions}
    assert await unmapped(broker.process.pid, held.segment.name)  # the broker let go of the server's memory
    assert mapped(broker.process.pid, free.segment.name)


async def test_a_server_that_dies_loses_its_engines(brokers, engines, request_id):
    """SIGKILL of the process holding the session: no goodbye, only the connection closing."""
    broker = brokers.decode
    watcher = await engines.make(broker, "decode", fill="canary")  # not held: it only carries the probe
    script = textwrap.dedent(f"""
        import asyncio, grpc, sys
        from kvbroker_tools import shapes
        from kvbroker_client.shm import SharedSegment
        from kvbroker_client.v1 import broker_service_pb2 as bpb, broker_service_pb2_grpc as bpb_grpc
        from tests.support.brokers import SMALL

        async def main():
            stub = bpb_grpc.BrokerServiceStub(grpc.aio.insecure_channel({broker.process.listen!r}))
            call = stub.OpenSession(bpb.OpenSessionRequest(holder="doomed"))
            session_id = (await call.read()).session_id
            placements = shapes.place_buffers(SMALL)
            segment = SharedSegment.create(shapes.pool_size(SMALL, placements), "kvbt-doomed")
            request = shapes.register_request("doomed/tp0-{request_id}", SMALL, segment, placements)
            request.session_id = session_id
            await stub.RegisterEngine(request, timeout=30)
            segment.unlink()  # the mapping keeps the memory; nothing is left in /dev/shm after the kill
            print(segment.name, flush=True)
            await asyncio.Event().wait()

        asyncio.run(main())
    """)
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                                                  cwd=Path(__file__).parents[2])
    try:
        segment_name = (await asyncio.wait_for(server.stdout.readline(), 60)).decode().strip()
        engine_id = f"doomed/tp0-{request_id}"
        probe = watcher.__class__(**{**watcher.__dict__, "engine_id": engine_id})
        watch = await grant_and_watch(probe, request_id)
        assert mapped(broker.process.pid, segment_name)
        os.kill(server.pid, signal.SIGKILL)
        status = await asyncio.wait_for(final_status(watch), 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.kill()
        await server.wait()
    assert status.state == pb.TRANSFER_STATE_FAILED and f"engine {engine_id!r} was unregistered" in status.reason
    info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    assert engine_id not in {e.engine_id for e in info.engines}
    assert "doomed" not in {s.holder for s in info.sessions}
    assert await unmapped(broker.process.pid, segment_name)


async def test_registering_under_an_unknown_session_is_not_found(brokers, engines):
    broker = brokers.decode
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await engines.make(broker, "decode", fill="canary", session_id="s-no-such-session")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error.value.details().startswith("session_id: no open session 's-no-such-session'")
    made = engines._made[-1]
    assert not mapped(broker.process.pid, made.segment.name)


async def test_registering_under_an_ended_session_is_not_found(brokers, engines, request_id):
    broker = brokers.decode
    async with session(broker.stub) as (session_id, _):
        held = await engines.make(broker, "decode", fill="canary", session_id=session_id)
        watch = await grant_and_watch(held, request_id)
    assert (await asyncio.wait_for(final_status(watch), 30)).state == pb.TRANSFER_STATE_FAILED  # it has ended
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await engines.make(broker, "decode", fill="canary", session_id=session_id)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error.value.details().startswith(f"session_id: no open session {session_id!r}")


async def test_an_engine_unregistered_by_its_server_is_not_released_twice(brokers, engines):
    broker = brokers.decode
    async with session(broker.stub) as (session_id, _):
        held = await engines.make(broker, "decode", fill="canary", session_id=session_id)
        await broker.stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=held.engine_id), timeout=10)
        again = await broker.stub.RegisterEngine(  # the same id, now without a session
            engines_request(held), timeout=30)
        assert again.engine.session_id == ""
        info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
        assert [list(s.engine_ids) for s in info.sessions if s.session_id == session_id] == [[]]
    probe = await grant_and_watch(held, "after-session")  # still registered after the session ended...
    await broker.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=held.engine_id, request_id="after-session"),
                                     timeout=10)
    status = await final_status(probe)
    assert status.code == grpc.StatusCode.CANCELLED.value[0]  # ...so its grant ends by the cancel, not the session
    assert mapped(broker.process.pid, held.segment.name)


def engines_request(engine) -> bpb.RegisterEngineRequest:
    from kvbroker_tools import shapes

    return shapes.register_request(engine.engine_id, engine.shape, engine.segment, engine.placements)


async def test_shutdown_ends_session_streams_cleanly(backend, engines):
    broker = await open_broker("session-shutdown", backend)
    try:
        async with session(broker.stub) as (session_id, call):
            await engines.make(broker, "decode", fill="canary", session_id=session_id)
            broker.process.process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            assert await asyncio.wait_for(broker.process.process.wait(), 30) == 0
    finally:
        await close_broker(broker)


async def test_holder_longer_than_the_limit_is_invalid(brokers):
    call = brokers.decode.stub.OpenSession(bpb.OpenSessionRequest(holder="x" * 129))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "holder: 129 characters exceed the limit of 128"
