"""Counters from facts, on real brokers: a receiver's pages, bytes and truncated_pages come from its
own grant and its engine's item_len, never from what a sender reports; a claim that names a page
twice is refused. truncated_pages is one thing on both sides: the entries of the receiver's grant
(the claimed list, in the claimed flow) that the request left unfilled.

The lying sender is a raw PeerService of the test's own: decode offers it the grant (so it holds the
offer's token, as a real sender would) and it reports the part with figures of its choosing."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from tests.support.brokers import ALL, close_broker, open_broker
from tests.support.flows import INDEX, MAIN, grant, offer, part, refusal, transfer, watch_first
from tests.support.helpers import scrape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def decode(backend):
    """A decode broker with its metrics endpoint: the counters are read there."""
    broker = await open_broker(f"decode-counters-{backend}", backend, "--metrics-listen", "127.0.0.1:0")
    yield broker
    await close_broker(broker)


@contextlib.asynccontextmanager
async def peer(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        yield ppb_grpc.PeerServiceStub(channel)


def item_of(engine, *components: int) -> int:
    """One page over every layer buffer of `components`: the bytes the receiver counts per page."""
    return sum(p.item_len for p in engine.placements if p.component in components)


async def test_a_claim_naming_a_page_twice_is_refused_and_counts_stay_within_the_grant(decode, engines, request_id):
    dst = await engines.make(decode, "decode", fill="canary")
    await grant(dst, request_id, [1])
    before = await scrape(decode.process.metrics_listen)
    async with peer(decode.peer_address) as stub:
        claim = ppb.ClaimGrantRequest(broker_id="prefill-x", engine_id=dst.engine_id, request_id=request_id,
                                      components=ALL, dst_page_ids=[1] * 10**6)  # the claim
        refused = await refusal(stub.ClaimGrant(claim, timeout=30))
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        assert "dst_page_ids: page id 1 appears more than once" in refused.details()
        assert "a page of the grant is claimed at most once" in refused.details()
        assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING  # still claimable
        claim.ClearField("dst_page_ids")
        claim.dst_page_ids.append(1)
        claimed = await stub.ClaimGrant(claim, timeout=10)
        lying = await stub.CompleteTransfer(ppb.CompleteTransferRequest(
            broker_id="prefill-x", engine_id=dst.engine_id, request_id=request_id, claim_token=claimed.claim_token,
            succeeded=True, pages=2**32 - 1, runs=2**32 - 1, bytes=2**64 - 1, truncated_pages=2**32 - 1), timeout=10)
    assert lying.state == pb.TRANSFER_STATE_SUCCEEDED
    status = await watch_first(dst, request_id)
    assert (status.pages, status.bytes, status.truncated_pages) == (1, item_of(dst, MAIN, INDEX), 0)
    after = await scrape(decode.process.metrics_listen)
    assert after["kvbroker_transferred_pages_total"] - before.get("kvbroker_transferred_pages_total", 0) == 1
    assert after["kvbroker_transferred_bytes_total"] - before.get("kvbroker_transferred_bytes_total", 0) == \
        item_of(dst, MAIN, INDEX)
    assert after.get("kvbroker_truncated_pages_total", 0) == before.get("kvbroker_truncated_pages_total", 0)


@pytest.mark.parametrize("granted, sent, moved, unfilled", [(5, 3, 3, 2), (3, 5, 3, 0)])
async def test_the_claimed_flow_counts_the_grant_entries_left_unfilled_on_both_sides(
        brokers, engines, request_id, granted, sent, moved, unfilled):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await grant(dst, request_id, range(10, 10 + granted))
    reply = await transfer(src, dst, request_id, range(sent))
    assert (reply.status.pages, reply.status.truncated_pages) == (moved, unfilled)
    status = await watch_first(dst, request_id)
    assert (status.pages, status.bytes, status.truncated_pages) == (moved, moved * item_of(dst, MAIN, INDEX),
                                                                    unfilled)


async def test_the_offered_flow_counts_the_grant_entries_left_unfilled_on_both_sides(brokers, engines, request_id):
    """MINIMAX_INDEX_K shorter than its grant: cut to the shorter (rule index-k-truncate), so two of its
    five entries stay unfilled, on the sender's status and the receiver's alike."""
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await offer(dst, src, request_id, {MAIN: [1, 2, 3], INDEX: [4, 5, 6, 7, 8]})
    done = await part(src, request_id, {MAIN: [0, 1, 2], INDEX: [0, 1, 2]})
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert (done.status.pages, done.status.truncated_pages) == (6, 2)
    status = await watch_first(dst, request_id)
    assert (status.pages, status.bytes, status.truncated_pages) == (6, 3 * item_of(dst, MAIN) + 3 * item_of(dst, INDEX),
                                                                    2)


class Sender(ppb_grpc.PeerServiceServicer):
    """A sending broker that takes decode's offer and answers as `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.offers: list[ppb.OfferGrantRequest] = []

    async def OfferGrant(self, request, context):
        self.offers.append(request)
        return ppb.OfferGrantResponse(broker_id=self.name, epoch=1)


async def test_a_senders_figures_in_a_part_notice_are_not_counted(decode, engines, request_id):
    dst = await engines.make(decode, "decode", fill="canary")
    sender = Sender("prefill-liar")
    server = grpc.aio.server()
    ppb_grpc.add_PeerServiceServicer_to_server(sender, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        before = await scrape(decode.process.metrics_listen)
        await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=request_id, engine_id=dst.engine_id, expiry_ms=30_000, sender_address=f"127.0.0.1:{port}",
            pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2, 3, 4, 5])]), timeout=10)
        token = sender.offers[-1].offer_token
        async with peer(decode.peer_address) as stub:
            acks = await stub.NotifyParts(ppb.NotifyPartsRequest(broker_id="prefill-liar", notices=[ppb.PartNotice(
                engine_id=dst.engine_id, request_id=request_id, offer_token=token, part=0, parts_total=1,
                succeeded=True, landed=[ppb.PartLanded(component=MAIN, dst_offset=0, pages=2)],
                truncated_pages=2**32 - 1)]), timeout=10)
        assert acks.acks[0].state == pb.TRANSFER_STATE_SUCCEEDED, acks
        status = await watch_first(dst, request_id)
        assert (status.pages, status.bytes, status.truncated_pages) == (2, 2 * item_of(dst, MAIN), 3)
        after = await scrape(decode.process.metrics_listen)
        assert after["kvbroker_truncated_pages_total"] - before.get("kvbroker_truncated_pages_total", 0) == 3
    finally:
        await server.stop(None)
