"""The offered flow when things go wrong, on real brokers and engines: the offer is lost or late,
the sender's broker restarts or dies, the receiver cancels or its grant expires between parts.
Every case ends both sides with a clear code, and nothing is written after the grant ended."""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import assert_bytes, close_broker, open_broker
from tests.support.flows import M3, MAIN, expect_pages, offer, part, refusal, watch_all, watch_first

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def state_of(engine, request_id):
    return (await watch_first(engine, request_id)).state


async def test_an_offer_that_cannot_reach_its_sender_fails_the_grant(brokers, engines, request_id):
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    error = await refusal(dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, sender_address=f"127.0.0.1:{free_port()}",
        pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2, 3])]), timeout=30))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "the offer to the sender broker" in error.details()
    final = (await watch_all(dst, request_id))[-1]
    assert final.state == pb.TRANSFER_STATE_FAILED and final.code == grpc.StatusCode.UNAVAILABLE.value[0]


async def test_an_offer_to_an_unknown_sender_engine_is_refused_at_once(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", components=M3)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    error = await refusal(dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, sender_address=src.broker.peer_address,
        sender_engine_id="prefill-nobody/tp0", pages=[pb.ComponentPages(component=MAIN, page_ids=[1])]), timeout=30))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "is registered on this broker" in error.details()
    assert (await state_of(dst, request_id)) == pb.TRANSFER_STATE_FAILED


async def test_an_offer_arriving_after_the_sender_gave_up_is_refused(backend, brokers, engines, request_id):
    prefill = await open_broker(f"prefill-impatient-{backend}", backend, "--offer-wait-s", "0.2")
    try:
        src = await engines.make(prefill, "prefill", components=M3)
        dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
        before = dst.segment.array.copy()
        gave_up = await refusal(part(src, request_id, {MAIN: [0, 1]}))
        assert gave_up.code() == grpc.StatusCode.NOT_FOUND and "offer_wait_s" in gave_up.details()
        late = await refusal(offer(dst, src, request_id, {MAIN: [5, 6]}, sender_engine=False))
        assert late.code() == grpc.StatusCode.FAILED_PRECONDITION and "gave up" in late.details()
        assert (await state_of(dst, request_id)) == pb.TRANSFER_STATE_FAILED
        assert_bytes(dst, before)
    finally:
        await close_broker(prefill)


async def test_a_sender_broker_that_restarts_between_offer_and_transfer(backend, brokers, engines, request_id):
    """The offer went with the old process: the new one's Transfer finds none and says so; the
    grant fails at its expiry, and nothing is written."""
    port = free_port()
    listen = ("--peer-listen", f"127.0.0.1:{port}", "--offer-wait-s", "0.5")
    prefill = await open_broker(f"prefill-restart-{backend}", backend, *listen)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    before = dst.segment.array.copy()
    try:
        src = await engines.make(prefill, "prefill", components=M3)
        await offer(dst, src, request_id, {MAIN: [3, 4]}, expiry_ms=2_000)
        prefill.process.kill()
        await prefill.process.process.wait()
        await close_broker(prefill)
        prefill = await open_broker(f"prefill-restart-{backend}", backend, *listen)
        again = await engines.make(prefill, "prefill", components=M3)
        missing = await refusal(part(again, request_id, {MAIN: [0, 1]}))
        assert missing.code() == grpc.StatusCode.NOT_FOUND and "no offer" in missing.details()
        final = (await watch_all(dst, request_id))[-1]
        assert final.state == pb.TRANSFER_STATE_FAILED and final.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert_bytes(dst, before)
    finally:
        await close_broker(prefill)


async def test_a_sender_broker_that_stops_tells_the_receivers_of_the_offers_it_held(backend, brokers, engines,
                                                                                    request_id):
    """A drain (SIGTERM) fails every grant offered to the broker at once, with the reason: an offer
    naming an engine (a request on it) and one naming none, which no request held yet."""
    prefill = await open_broker(f"prefill-stopping-{backend}", backend)
    try:
        src = await engines.make(prefill, "prefill", components=M3)
        dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
        before = dst.segment.array.copy()
        named, unnamed = f"{request_id}-named", f"{request_id}-any"
        await offer(dst, src, named, {MAIN: [3, 4]}, expiry_ms=120_000)
        await offer(dst, src, unnamed, {MAIN: [5, 6]}, sender_engine=False, expiry_ms=120_000)
        watching = [asyncio.create_task(watch_all(dst, r, timeout=60)) for r in (named, unnamed)]
        assert await close_broker(prefill) == 0
        for seen in await asyncio.wait_for(asyncio.gather(*watching), 30):  # far before the expiry
            final = seen[-1]
            assert final.state == pb.TRANSFER_STATE_FAILED, final
            assert final.code == grpc.StatusCode.UNAVAILABLE.value[0] and "broker shut down" in final.reason, final
        assert_bytes(dst, before)
    finally:
        await close_broker(prefill)


async def test_the_receiver_cancelling_between_parts_stops_the_next_one(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=11)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    rng = np.random.default_rng(11)
    src_ids, dst_ids = rng.permutation(64)[:8], rng.permutation(64)[:8]
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: dst_ids})
    await part(src, request_id, {MAIN: src_ids[:4]}, last=False)
    cancelled = await dst.stub.CancelTransfer(bpb.CancelTransferRequest(
        engine_id=dst.engine_id, request_id=request_id, reason="decode aborted the request"), timeout=30)
    assert cancelled.status.state == pb.TRANSFER_STATE_FAILED
    next_part = await refusal(part(src, request_id, {MAIN: src_ids[4:]}, offsets={MAIN: 4}))
    assert next_part.code() == grpc.StatusCode.FAILED_PRECONDITION and "decode aborted" in next_part.details()
    sender = (await watch_all(src, request_id))[-1]
    assert sender.state == pb.TRANSFER_STATE_FAILED and sender.code == grpc.StatusCode.CANCELLED.value[0]
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_ids[:4], dst_ids[:4])]))


async def test_the_sender_cancelling_fails_the_grant_with_its_reason(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=12)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    await offer(dst, src, request_id, {MAIN: [1, 2, 3, 4]})
    await part(src, request_id, {MAIN: [1, 2]}, last=False)
    await src.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=src.engine_id, request_id=request_id,
                                                            reason="prefill aborted"), timeout=30)
    final = (await watch_all(dst, request_id))[-1]
    assert final.state == pb.TRANSFER_STATE_FAILED and final.code == grpc.StatusCode.CANCELLED.value[0]
    assert "prefill aborted" in final.reason


async def test_a_part_after_the_grant_expired_is_refused_and_writes_nothing(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=13)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: [7, 8, 9, 10]}, expiry_ms=1_500)
    await part(src, request_id, {MAIN: [0, 1]}, last=False)
    final = (await watch_all(dst, request_id))[-1]  # ends at the expiry
    assert final.state == pb.TRANSFER_STATE_FAILED and final.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    sender = (await watch_all(src, request_id))[-1]
    assert sender.state == pb.TRANSFER_STATE_FAILED
    late = await refusal(part(src, request_id, {MAIN: [2, 3]}, offsets={MAIN: 2}))
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [0, 1], [7, 8])]))


async def test_a_sender_that_dies_between_parts_leaves_the_grant_to_fail_at_expiry(backend, brokers, engines,
                                                                                  request_id):
    prefill = await open_broker(f"prefill-doomed-{backend}", backend)
    try:
        src = await engines.make(prefill, "prefill", components=M3, seed=14)
        dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
        before = dst.segment.array.copy()
        await offer(dst, src, request_id, {MAIN: [20, 21, 22, 23]}, expiry_ms=2_000)
        await part(src, request_id, {MAIN: [4, 5]}, last=False)
        watching = asyncio.create_task(watch_all(dst, request_id))
        prefill.process.kill()
        seen = await asyncio.wait_for(watching, 30)
        assert [s.state for s in seen][-1] == pb.TRANSFER_STATE_FAILED
        assert seen[-1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and seen[-1].parts == 1
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [4, 5], [20, 21])]))
    finally:
        await close_broker(prefill)
