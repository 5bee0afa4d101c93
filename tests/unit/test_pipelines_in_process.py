"""The send and receive pipelines whole, between two Brokers of one process (tests/support/linked_brokers.py:
a PeerLink that calls the other Broker, a backend that writes with memmove): every flow's bytes, its
final states on both sides, and the peer calls it took, without a process, a port or an engine. The
same flows through real brokers and engines are tests/integration's."""

from __future__ import annotations

import contextlib

import numpy as np

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.model import TransferState
from kvbroker.edge import convert
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from tests.support.linked_brokers import HostEngine, Side, host_engine, linked_pair

ALL = (pb.COMPONENT_MAIN_KV, pb.COMPONENT_MINIMAX_INDEX_K)
SRC = np.array([3, 4, 5, 9, 10, 20])
DST = np.array([40, 41, 42, 7, 8, 30])


async def final(side: Side, engine: HostEngine, request_id: str):
    updates = await side.broker.watch(engine.engine_id, request_id, terminal_only=True)
    async with contextlib.aclosing(updates):
        return [status async for status in updates][-1]


def expected(src: HostEngine, before: np.ndarray, dst: HostEngine) -> np.ndarray:
    return shapes.expected_destination(src.segment.array, before, shapes.SMALL, dst.placements, set(ALL), SRC, DST)


async def offer(decode: Side, dst: HostEngine, prefill: Side, request_id: str, components=ALL):
    grant = bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id, sender_address=prefill.address,
                                      pages=[pb.ComponentPages(component=c, page_ids=DST.tolist()) for c in components])
    return await decode.broker.expect_transfer(dst.engine_id, lambda: convert.grant_command_in(grant))


async def part(prefill: Side, src: HostEngine, request_id: str, pages: slice, *, last: bool, aux: bytes = b""):
    request = bpb.TransferRequest(request_id=request_id, engine_id=src.engine_id, more_parts=not last, aux=aux,
                                  pages=[bpb.PartPages(component=c, src_page_ids=SRC[pages].tolist(),
                                                       dst_offset=pages.start or 0) for c in ALL])
    return await prefill.broker.transfer(src.engine_id, lambda: convert.transfer_command_in(request), 30.0)


async def test_an_offered_grant_in_two_parts_lands_every_byte_and_hands_the_aux_over():
    async with linked_pair() as (prefill, decode):
        src = await host_engine(prefill, "prefill", fill="random", seed=1)
        dst = await host_engine(decode, "decode", fill="canary")
        before = dst.segment.array.copy()
        assert (await offer(decode, dst, prefill, "r1")).state is TransferState.PENDING
        assert (await part(prefill, src, "r1", slice(0, 3), last=False)).state is TransferState.TRANSFERRING
        assert (await part(prefill, src, "r1", slice(3, 6), last=True, aux=b"token 17")).state \
            is TransferState.SUCCEEDED
        received = await final(decode, dst, "r1")
        assert (received.state, received.aux, received.parts) == (TransferState.SUCCEEDED, b"token 17", 2)
        np.testing.assert_array_equal(dst.segment.array, expected(src, before, dst))
        # the peer calls one request takes: the offer, one handshake, one notice per part
        assert decode.peers.calls == ["OfferGrant"]
        assert prefill.peers.calls == ["Handshake", "NotifyParts", "NotifyParts"]


async def test_a_claimed_grant_lands_every_byte_in_one_transfer():
    async with linked_pair() as (prefill, decode):
        src = await host_engine(prefill, "prefill", fill="random", seed=2)
        dst = await host_engine(decode, "decode", fill="canary")
        before = dst.segment.array.copy()
        grant = bpb.ExpectTransferRequest(request_id="r2", engine_id=dst.engine_id, components=ALL,
                                          dst_page_ids=DST.tolist())
        await decode.broker.expect_transfer(dst.engine_id, lambda: convert.grant_command_in(grant))
        send = bpb.TransferRequest(request_id="r2", engine_id=src.engine_id, peer_address=decode.address,
                                   remote_engine_id=dst.engine_id, components=ALL, src_page_ids=SRC.tolist())
        sent = await prefill.broker.transfer(src.engine_id, lambda: convert.transfer_command_in(send), 30.0)
        assert sent.state is TransferState.SUCCEEDED
        assert (await final(decode, dst, "r2")).state is TransferState.SUCCEEDED
        np.testing.assert_array_equal(dst.segment.array, expected(src, before, dst))
        assert prefill.peers.calls == ["Handshake", "ClaimGrant", "CompleteTransfer"] and decode.peers.calls == []


async def test_a_part_with_a_component_the_grant_lacks_is_refused_and_writes_nothing():
    async with linked_pair() as (prefill, decode):
        src = await host_engine(prefill, "prefill", fill="random", seed=3)
        dst = await host_engine(decode, "decode", fill="canary")
        before = dst.segment.array.copy()
        await offer(decode, dst, prefill, "r3", components=ALL[:1])  # MAIN_KV only
        try:
            await part(prefill, src, "r3", slice(0, 6), last=True)  # MAIN_KV and MINIMAX_INDEX_K
        except BrokerError as exc:
            refused = exc
        else:
            raise AssertionError("a part past the grant was taken")
        assert refused.code is Code.PERMISSION_DENIED, refused
        assert refused.reason == "pages: MINIMAX_INDEX_K is not in the grant"
        assert prefill.broker.backend.rows_written == 0
        np.testing.assert_array_equal(dst.segment.array, before)
