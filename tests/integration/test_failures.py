"""Failure semantics with real brokers: kills, restarts, SIGTERM, unregistration, cancellation.

Nothing may wait forever, nothing may write where it was not granted, and a broker that lost a
peer must work again with the next one. "Mid-transfer" is observed, not timed: the receiver's
watcher reports TRANSFERRING once the sender has claimed the grant and is writing.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import ALL, assert_bytes, close_broker, expected_after, open_broker
from tests.support.flows import MEDIUM, free_port, grant, transfer_call, until_state

pytestmark = pytest.mark.integration

# About 350 MB per request: long enough on loopback that "mid-transfer" is a real window.


@pytest.fixture
async def pair(backend):
    """A broker pair of this test's own, so it may be killed."""
    made = [await open_broker(f"prefill-own-{backend}", backend),
            await open_broker(f"decode-own-{backend}", backend, "--peer-rpc-timeout-s", "2")]
    yield made
    for broker in made:
        broker.process.kill()
        await close_broker(broker)


async def test_receiver_killed_mid_transfer_ends_the_transfer_within_its_deadline(pair, engines, request_id):
    prefill, decode = pair
    src = await engines.make(prefill, "prefill", MEDIUM)
    dst = await engines.make(decode, "decode", MEDIUM, fill="canary")
    await grant(dst, request_id, range(MEDIUM.request_pages))
    sending = asyncio.ensure_future(transfer_call(src, dst, request_id, range(MEDIUM.request_pages), timeout=30))
    seen = await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
    assert seen[-1].state == pb.TRANSFER_STATE_TRANSFERRING
    decode.process.kill()
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(sending, 40)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), info.value.details()
    assert time.monotonic() - started < 30
    # the sender is healthy and says so
    final = await until_state(src, request_id, pb.TRANSFER_STATE_FAILED, timeout=10)
    assert final[-1].state == pb.TRANSFER_STATE_FAILED and final[-1].reason


async def test_receiver_killed_while_its_engine_moves_bytes_over_tcp_is_an_engine_error(backend, engines, request_id):
    """The engine fails the write as it runs (NIXL: while polling the transfer's state): the caller sees
    ABORTED or UNAVAILABLE with the engine's word, never INTERNAL, and the sender logs no traceback."""
    tcp = {"UCX_TLS": "tcp"}  # over UCX's shared memory a dead receiver's pages are still there to write
    prefill = await open_broker(f"prefill-tcp-{backend}", backend, env=tcp)
    decode = await open_broker(f"decode-tcp-{backend}", backend, "--peer-rpc-timeout-s", "2", env=tcp)
    try:
        src = await engines.make(prefill, "prefill", MEDIUM)
        dst = await engines.make(decode, "decode", MEDIUM, fill="canary")
        ids = np.arange(MEDIUM.request_pages)
        await grant(dst, request_id, ids)
        expected = expected_after(src, dst, dst.segment.array.copy(), ALL, ids, ids)
        sending = asyncio.ensure_future(transfer_call(src, dst, request_id, ids, timeout=30))
        await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
        decode.process.process.send_signal(signal.SIGSTOP)  # nothing lands from here on
        assert not np.array_equal(dst.segment.array, expected), "the write ended before the receiver was stopped"
        decode.process.kill()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(sending, 40)
        code, details = info.value.code(), info.value.details()
        assert code in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE), (code, details)
        assert f"transfer engine {backend}" in details, details
        tracebacks = [line for line in prefill.process.stderr_lines if "Traceback" in line]
        assert not tracebacks, "\n".join(prefill.process.stderr_lines[-40:])
    finally:
        for broker in (prefill, decode):
            broker.process.kill()
            await close_broker(broker)


async def test_sender_killed_mid_transfer_expires_the_grant_for_its_watchers(pair, engines, request_id):
    prefill, decode = pair
    src = await engines.make(prefill, "prefill", MEDIUM)
    dst = await engines.make(decode, "decode", MEDIUM, fill="canary")
    await grant(dst, request_id, range(MEDIUM.request_pages), expiry_ms=3000)
    sending = asyncio.ensure_future(transfer_call(src, dst, request_id, range(MEDIUM.request_pages)))
    await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
    prefill.process.kill()
    final = await until_state(dst, request_id, pb.TRANSFER_STATE_FAILED, timeout=20)
    assert final[-1].state == pb.TRANSFER_STATE_FAILED and "expired" in final[-1].reason
    with pytest.raises(grpc.aio.AioRpcError):
        await asyncio.wait_for(sending, 20)


async def test_peer_restart_is_noticed_and_the_next_transfer_succeeds(backend, engines, request_id):
    listen, peer = free_port(), free_port()
    flags = ("--listen", f"127.0.0.1:{listen}", "--peer-listen", f"127.0.0.1:{peer}")
    prefill = await open_broker("prefill-restart", backend)
    decode = await open_broker("decode-restart", backend, *flags)
    try:
        src = await engines.make(prefill, "prefill")
        dst = await engines.make(decode, "decode", fill="canary")
        await grant(dst, request_id, range(4))
        await transfer_call(src, dst, request_id, range(4))
        first_epoch = (await decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)).epoch
        assert await close_broker(decode) == 0

        decode = await open_broker("decode-restart", backend, *flags)
        again = await engines.make(decode, "decode", fill="canary")
        before = again.segment.array.copy()
        await grant(again, request_id + "-2", [7, 8, 9])
        reply = await transfer_call(src, again, request_id + "-2", [1, 2, 3])
        assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED
        assert_bytes(again, expected_after(src, again, before, ALL, [1, 2, 3], [7, 8, 9]))
        info = await prefill.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
        restarted = await decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
        (known,) = [p for p in info.peers if p.address == decode.peer_address]
        assert known.epoch == restarted.epoch and known.epoch != first_epoch
    finally:
        for broker in (prefill, decode):
            broker.process.kill()
            await close_broker(broker)


async def test_sigterm_drains_in_flight_transfers_and_refuses_new_ones(pair, engines, request_id):
    prefill, decode = pair
    src = await engines.make(prefill, "prefill", MEDIUM)
    dst = await engines.make(decode, "decode", MEDIUM, fill="canary")
    before = dst.segment.array.copy()
    ids = np.arange(MEDIUM.request_pages)
    await grant(dst, request_id, ids)
    await grant(dst, request_id + "-late", [MEDIUM.num_pages - 1])
    health = health_pb2_grpc.HealthStub(prefill.channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    assert (await health.read()).status == health_pb2.HealthCheckResponse.SERVING
    sending = asyncio.ensure_future(transfer_call(src, dst, request_id, ids))
    await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
    prefill.process.process.send_signal(signal.SIGTERM)
    assert (await health.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer_call(src, dst, request_id + "-late", [0])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
    reply = await asyncio.wait_for(sending, 60)
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert await asyncio.wait_for(prefill.process.process.wait(), 60) == 0
    after = expected_after(src, dst, before, ALL, ids, ids)
    assert_bytes(dst, after)


REUSED = 0x5A  # what a server writes into its memory once UnregisterEngine returned
SAMPLE = 512  # bytes: one of each is read back at the return (a page of MEDIUM's is 32 KiB)


async def unregister_mid_transfer(src, dst, request_id):
    """Start a transfer of the whole MEDIUM request into `dst`, unregister `dst` while it writes, and
    reuse the memory at once, as a server does. Returns every SAMPLE-th byte of the destination as it
    was when UnregisterEngine returned (a full copy would take longer than the write) and the sender's
    reply (or its error); a write after the reuse would show in the reused bytes."""
    ids = np.arange(MEDIUM.request_pages)
    await grant(dst, request_id, ids)
    sending = asyncio.ensure_future(transfer_call(src, dst, request_id, ids))
    await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
    await dst.stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=dst.engine_id), timeout=60)
    at_return = dst.segment.array[::SAMPLE].copy()
    dst.segment.array.fill(REUSED)
    try:
        outcome = await asyncio.wait_for(sending, 60)
    except grpc.aio.AioRpcError as exc:
        outcome = exc
    landed_late = np.flatnonzero(dst.segment.array != REUSED)
    assert landed_late.size == 0, (f"{landed_late.size} bytes landed after UnregisterEngine returned, first at "
                                   f"offset {landed_late[0]}")
    return at_return, outcome


async def test_unregistering_a_receiver_mid_transfer_waits_for_the_write(brokers, engines, request_id):
    """The write under way is let finish (unregister_wait_s): all of it landed before UnregisterEngine
    returned, and nothing after. Which of the two brokers answers its caller first is not promised."""
    src = await engines.make(brokers.prefill, "prefill", MEDIUM)
    dst = await engines.make(brokers.decode, "decode", MEDIUM, fill="canary")
    before = dst.segment.array.copy()
    at_return, outcome = await unregister_mid_transfer(src, dst, request_id)
    assert not isinstance(outcome, Exception) and outcome.status.state == pb.TRANSFER_STATE_SUCCEEDED, outcome
    ids = np.arange(MEDIUM.request_pages)
    expected = expected_after(src, dst, before, ALL, ids, ids)
    differ = np.flatnonzero(at_return != expected[::SAMPLE])
    assert differ.size == 0, f"{differ.size} bytes were not there yet when UnregisterEngine returned"


@pytest.fixture
async def impatient_decode(backend):
    """A decode broker whose UnregisterEngine does not wait for writes (unregister_wait_s 0)."""
    broker = await open_broker(f"decode-impatient-{backend}", backend, "--unregister-wait-s", "0")
    yield broker
    await close_broker(broker)


async def test_unregistering_without_waiting_cuts_the_write_off_before_it_returns(brokers, impatient_decode,
                                                                                 engines, request_id):
    """Unregistration releases the memory from the transfer engine before it returns, so a write it did
    not wait for fails at the sender (ABORTED, the engine's word) and lands nothing afterwards."""
    src = await engines.make(brokers.prefill, "prefill", MEDIUM)
    dst = await engines.make(impatient_decode, "decode", MEDIUM, fill="canary")
    _, outcome = await unregister_mid_transfer(src, dst, request_id)
    if isinstance(outcome, Exception):  # usual: the write was still under way when the memory went
        assert outcome.code() == grpc.StatusCode.ABORTED, outcome.details()
    else:  # the write ended before the unregistration began: it landed before it returned, nothing after
        assert outcome.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert impatient_decode.process.process.returncode is None, "the decode broker died"


async def test_cancelling_an_outgoing_transfer_fails_it_on_both_sides(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", MEDIUM)
    dst = await engines.make(brokers.decode, "decode", MEDIUM, fill="canary")
    ids = np.arange(MEDIUM.request_pages)
    await grant(dst, request_id, ids)
    sending = asyncio.ensure_future(transfer_call(src, dst, request_id, ids))
    await until_state(dst, request_id, pb.TRANSFER_STATE_TRANSFERRING)
    await src.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=src.engine_id, request_id=request_id,
                                                            reason="prefill aborted"), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(sending, 30)
    assert info.value.code() == grpc.StatusCode.CANCELLED and "prefill aborted" in info.value.details()
    final = await until_state(dst, request_id, pb.TRANSFER_STATE_FAILED, timeout=10)
    assert final[-1].state == pb.TRANSFER_STATE_FAILED and "prefill aborted" in final[-1].reason


async def test_a_watcher_that_disconnects_leaves_the_request_alone(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, range(4))
    for _ in range(5):  # watchers come and go
        call = dst.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id),
                                      timeout=10)
        assert (await call.read()).status.state == pb.TRANSFER_STATE_PENDING
        call.cancel()
    reply = await transfer_call(src, dst, request_id, range(4))
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expected_after(src, dst, before, ALL, range(4), range(4)))
