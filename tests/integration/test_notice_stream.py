"""The peer notice stream (PeerService.NotifyStream) on real brokers and engines: the offered flow's
part notices, and its offers, go as its messages; to a broker that does not serve it they go as
NotifyParts and OfferGrant calls, byte for byte the same; a stranger's stream is bounded (streams
per host, bytes per message) and a refused message (a notice or an offer) is answered on the
stream, which goes on."""

from __future__ import annotations

import dataclasses
import secrets

import grpc
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from kvbroker_tools import shapes
from tests.support.brokers import assert_bytes, close_brokers, open_broker
from tests.support.flows import MAIN, expect_pages, offer, part, watch_first
from tests.support.helpers import scrape

pytestmark = pytest.mark.integration

METRICS = ("--metrics-listen", "127.0.0.1:0")


@pytest.fixture
async def old_decode(backend):
    """A prefill broker beside a decode broker that answers NotifyStream UNIMPLEMENTED, as brokers
    before it did."""
    prefill = await open_broker(f"ns-prefill-{backend}", backend, *METRICS)
    decode = await open_broker(f"ns-decode-{backend}", backend, *METRICS, env={"KVBROKER_PEER_NOTICE_STREAM": "false"})
    yield prefill, decode
    await close_brokers(prefill, decode)


@pytest.fixture
async def old_prefill(backend):
    """A decode broker beside a prefill broker that answers NotifyStream UNIMPLEMENTED."""
    prefill = await open_broker(f"ns-old-prefill-{backend}", backend, env={"KVBROKER_PEER_NOTICE_STREAM": "false"})
    decode = await open_broker(f"ns-new-decode-{backend}", backend, *METRICS)
    yield prefill, decode
    await close_brokers(prefill, decode)


async def test_offers_to_a_broker_without_the_stream_go_as_offer_grant_calls(old_prefill, engines, request_id):
    prefill, decode = old_prefill
    src = await engines.make(prefill, "prefill", seed=4)
    dst = await engines.make(decode, "decode", fill="canary")
    before_bytes = dst.segment.array.copy()
    before = await scrape(decode.process.metrics_listen)
    for rid in (request_id, request_id + "-again"):  # the second after UNIMPLEMENTED was seen
        await offer(dst, src, rid, {MAIN: [5, 6]})
        await part(src, rid, {MAIN: [2, 3]})
        status = await watch_first(dst, rid)
        assert status.state == pb.TRANSFER_STATE_SUCCEEDED, status
        assert_bytes(dst, expect_pages(src, dst, before_bytes, [(MAIN, [2, 3], [5, 6])]))
    after = await scrape(decode.process.metrics_listen)
    assert after["kvbroker_peer_offers_total"] - before.get("kvbroker_peer_offers_total", 0) == 2
    assert after["kvbroker_peer_offers_streamed_total"] == before.get("kvbroker_peer_offers_streamed_total", 0)


async def test_notices_to_a_broker_without_the_stream_go_as_notify_parts_calls(old_decode, engines, request_id):
    prefill, decode = old_decode
    src = await engines.make(prefill, "prefill", seed=5)
    dst = await engines.make(decode, "decode", fill="canary")
    before_bytes = dst.segment.array.copy()
    before = await scrape(prefill.process.metrics_listen)
    await offer(dst, src, request_id, {MAIN: [7, 8, 9, 10]})
    await part(src, request_id, {MAIN: [0, 1]}, last=False)
    await part(src, request_id, {MAIN: [2, 3]}, offsets={MAIN: 2})
    status = await watch_first(dst, request_id)
    assert status.state == pb.TRANSFER_STATE_SUCCEEDED, status
    assert_bytes(dst, expect_pages(src, dst, before_bytes, [(MAIN, [0, 1, 2, 3], [7, 8, 9, 10])]))
    after = await scrape(prefill.process.metrics_listen)
    assert after["kvbroker_peer_notify_calls_total"] - before.get("kvbroker_peer_notify_calls_total", 0) == 2
    assert after["kvbroker_peer_notify_streamed_total"] == before.get("kvbroker_peer_notify_streamed_total", 0)


async def test_notices_still_arrive_when_a_stranger_holds_the_last_notice_stream(backend, engines, request_id):
    """The decode broker holds one notice stream; a stranger has it. The prefill broker's stream is
    refused as it opens, before any notice is read, and its notices go as NotifyParts calls."""
    prefill = await open_broker(f"ns-full-prefill-{backend}", backend, *METRICS)
    decode = await open_broker(f"ns-full-decode-{backend}", backend, "--max-peer-notice-streams", "1")
    channel = grpc.aio.insecure_channel(decode.peer_address)
    try:
        squatter = ppb_grpc.PeerServiceStub(channel).NotifyStream(timeout=60)
        await squatter.write(batch(1, "mallory"))
        assert (await squatter.read()).seq == 1  # held: the broker's only notice stream
        src = await engines.make(prefill, "prefill", seed=6)
        dst = await engines.make(decode, "decode", fill="canary")
        before_bytes = dst.segment.array.copy()
        before = await scrape(prefill.process.metrics_listen)
        await offer(dst, src, request_id, {MAIN: [3, 4]})
        await part(src, request_id, {MAIN: [0, 1]})
        status = await watch_first(dst, request_id)
        assert status.state == pb.TRANSFER_STATE_SUCCEEDED, status
        assert_bytes(dst, expect_pages(src, dst, before_bytes, [(MAIN, [0, 1], [3, 4])]))
        after = await scrape(prefill.process.metrics_listen)
        assert after["kvbroker_peer_notify_calls_total"] - before.get("kvbroker_peer_notify_calls_total", 0) == 1
        assert after["kvbroker_peer_notify_streamed_total"] == before.get("kvbroker_peer_notify_streamed_total", 0)
        squatter.cancel()
    finally:
        await channel.close()
        await close_brokers(prefill, decode)


@pytest.fixture
async def guarded(backend):
    """A broker admitting prefill-* only, holding at most 2 notice streams per peer host."""
    decode = await open_broker(f"ns-guard-{backend}", backend, "--peer-allow", "prefill-*",
                               "--max-notice-streams-per-peer", "2", *METRICS)
    channel = grpc.aio.insecure_channel(decode.peer_address)
    yield decode, ppb_grpc.PeerServiceStub(channel)
    await channel.close()
    await close_brokers(decode)


def batch(seq: int, broker_id: str, aux: bytes = b"") -> ppb.NotifyStreamRequest:
    return ppb.NotifyStreamRequest(seq=seq, notices=ppb.NotifyPartsRequest(broker_id=broker_id, notices=[
        ppb.PartNotice(engine_id="no-such-engine", request_id=secrets.token_hex(8), offer_token=secrets.token_hex(16),
                       part=0, parts_total=1, succeeded=True, aux=aux,
                       landed=[ppb.PartLanded(component=MAIN, dst_offset=0, pages=1)])]))


async def test_a_refused_message_is_answered_on_the_stream_which_goes_on(guarded):
    _, peer = guarded
    stream = peer.NotifyStream(timeout=30)
    await stream.write(batch(41, "mallory"))
    refused = await stream.read()
    assert (refused.seq, refused.code) == (41, grpc.StatusCode.PERMISSION_DENIED.value[0]), refused
    assert "peer_allow" in refused.reason and not refused.acks.acks
    await stream.write(batch(42, "prefill-9"))
    answered = await stream.read()
    assert (answered.seq, answered.code) == (42, 0), answered
    assert len(answered.acks.acks) == 1 and answered.acks.acks[0].code == grpc.StatusCode.NOT_FOUND.value[0]
    await stream.done_writing()
    assert await stream.read() is grpc.aio.EOF
    assert await stream.code() is grpc.StatusCode.OK


async def test_streams_beyond_the_per_host_bound_are_refused_and_one_closed_makes_room(guarded):
    decode, peer = guarded
    before = await scrape(decode.process.metrics_listen)
    held = [peer.NotifyStream(timeout=30) for _ in range(2)]
    for seq, stream in enumerate(held):
        await stream.write(batch(seq, "prefill-9"))
        assert (await stream.read()).seq == seq  # its handler runs: the stream is counted
    third = peer.NotifyStream(timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await third.read()  # refused as it opens, before any message (a sender waits for that)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "max_notice_streams_per_peer" in refused.value.details()
    await held[0].done_writing()
    assert await held[0].read() is grpc.aio.EOF  # its handler has returned, and given its place back
    fresh = peer.NotifyStream(timeout=30)
    await fresh.write(batch(8, "prefill-9"))
    assert (await fresh.read()).seq == 8
    for stream in (held[1], fresh):
        stream.cancel()
    after = await scrape(decode.process.metrics_listen)
    assert after["kvbroker_refused_requests_total"] - before.get("kvbroker_refused_requests_total", 0) >= 1


async def test_a_message_over_the_streams_bound_ends_it_unread_and_the_broker_goes_on(guarded, engines):
    decode, peer = guarded
    stream = peer.NotifyStream(timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stream.write(batch(1, "prefill-9", aux=b"\0" * (2 << 20)))
        await stream.read()
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "notice stream" in refused.value.details()
    again = peer.NotifyStream(timeout=30)
    await again.write(batch(2, "prefill-9"))
    assert (await again.read()).seq == 2
    again.cancel()
    assert (await engines.make(decode, "decode")).engine_id  # still serving


def offer_message(seq: int, broker_id: str, sender_engine_id: str = "") -> ppb.NotifyStreamRequest:
    return ppb.NotifyStreamRequest(seq=seq, notices=ppb.NotifyPartsRequest(broker_id=broker_id, epoch=3),
                                   offer=ppb.OfferGrantRequest(
        broker_id=broker_id, epoch=3, peer_address="127.0.0.1:9", engine_id="decode-x/tp0",
        request_id=secrets.token_hex(8), sender_engine_id=sender_engine_id,
        pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2])], remaining_ms=30_000,
        offer_token=secrets.token_hex(16), generation=1))


async def test_an_offer_on_the_stream_is_answered_or_refused_in_its_response(guarded):
    """Offers on a NotifyStream are checked as OfferGrant calls are: a stranger's refused, one naming an
    unknown sender engine NOT_FOUND, each in its response while the stream goes on; an admitted
    peer's is taken and answered with the broker's id."""
    decode, peer = guarded
    stream = peer.NotifyStream(timeout=30)
    answers = []
    for message in (offer_message(1, "mallory"), offer_message(2, "prefill-9", "no-such-engine"),
                    offer_message(3, "prefill-9")):
        await stream.write(message)
        answers.append(await stream.read())
    assert [(a.seq, a.code) for a in answers] == [(1, grpc.StatusCode.PERMISSION_DENIED.value[0]),
                                                 (2, grpc.StatusCode.NOT_FOUND.value[0]), (3, 0)], answers
    assert "peer_allow" in answers[0].reason and "no-such-engine" in answers[1].reason
    assert not answers[0].HasField("offer") and not answers[1].HasField("offer")
    info = await decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    assert answers[2].offer.broker_id == info.broker_id and answers[2].offer.epoch == info.epoch
    await stream.done_writing()
    assert await stream.read() is grpc.aio.EOF


# Many pages of one byte or so each: a grant whose offer is over the stream's 512 KiB.
WIDE = dataclasses.replace(shapes.SMALL, name="wide", dense_layers=1, sparse_layers=0, page_size=1, head_dim=1,
                           num_pages=1 << 18)


@pytest.fixture
async def pair_with_metrics(backend):
    prefill = await open_broker(f"ns-big-prefill-{backend}", backend)
    decode = await open_broker(f"ns-big-decode-{backend}", backend, *METRICS)
    yield prefill, decode
    await close_brokers(prefill, decode)


async def test_an_offer_over_the_streams_bound_goes_as_an_offer_grant_call(pair_with_metrics, engines, request_id):
    """A grant of 2^18 - 64 pages: its offer (about 750 KiB) is an OfferGrant call, the small one beside
    it a message of the stream, and both grants are written."""
    prefill, decode = pair_with_metrics
    src = await engines.make(prefill, "prefill", WIDE, components=("MAIN_KV",), seed=8)
    dst = await engines.make(decode, "decode", WIDE, components=("MAIN_KV",), fill="canary")
    before_bytes = dst.segment.array.copy()
    before = await scrape(decode.process.metrics_listen)
    many = (1 << 18) - 64
    await offer(dst, src, request_id, {MAIN: list(range(64, 64 + many))})
    await offer(dst, src, request_id + "-small", {MAIN: [0, 1]})
    after = await scrape(decode.process.metrics_listen)
    assert after["kvbroker_peer_offers_total"] - before.get("kvbroker_peer_offers_total", 0) == 2
    assert after["kvbroker_peer_offers_streamed_total"] - before.get("kvbroker_peer_offers_streamed_total", 0) == 1
    await part(src, request_id, {MAIN: list(range(many))})
    await part(src, request_id + "-small", {MAIN: [5, 6]})
    for rid in (request_id, request_id + "-small"):
        assert (await watch_first(dst, rid)).state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expect_pages(src, dst, before_bytes, [(MAIN, list(range(many)), list(range(64, 64 + many))),
                                                            (MAIN, [5, 6], [0, 1])]))
