"""The decode-initiated (offered) flow on two real brokers and real engines: the receiver offers its
grant to the sender's broker, the sender writes it in parts (chunked prefill), each component on
its own page list, and the last part carries the state components and the aux bytes."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import SMALL, assert_bytes
from tests.support.flows import (
    DENSE,
    INDEX,
    M3,
    MAIN,
    expect_pages,
    offer,
    part,
    refusal,
    rest,
    watch_all,
    watch_first,
)

pytestmark = pytest.mark.integration



async def m3_pair(brokers, engines, seed=0):
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=seed)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    return src, dst


def pick(rng, n):
    return rng.permutation(SMALL.num_pages)[:n]


async def test_one_part_moves_every_component_and_ends_both_sides_succeeded(brokers, engines, request_id):
    src, dst = await m3_pair(brokers, engines)
    rng = np.random.default_rng(1)
    dst_main, src_main = pick(rng, 8), pick(rng, 8)
    before = dst.segment.array.copy()
    reply = await offer(dst, src, request_id, {MAIN: dst_main})
    assert reply.status.state == pb.TRANSFER_STATE_PENDING
    sender_side = await watch_first(src, request_id)  # the named sender engine holds the offer as PENDING
    assert sender_side.state == pb.TRANSFER_STATE_PENDING and sender_side.role == pb.TRANSFER_ROLE_SENDER
    done = await part(src, request_id, {MAIN: src_main}, aux=b"first token")
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED and done.status.parts == 1
    assert done.status.pages == 8 and done.status.aux == b""  # aux is the receiver's
    seen = await watch_all(dst, request_id)
    assert seen[-1].state == pb.TRANSFER_STATE_SUCCEEDED and seen[-1].aux == b"first token"
    assert seen[-1].bytes == 8 * SMALL.kv_item_len * 2 * SMALL.sparse_layers
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_main, dst_main)]))


async def test_a_chunked_minimax_request_lands_every_component_and_the_aux_with_success(brokers, engines, request_id):
    """Main KV in three chunks; the index-K suffix after a 2-page decode prefix and the dense KV of
    every page come with the last chunk, with the aux bytes; each on its own page list."""
    src, dst = await m3_pair(brokers, engines, seed=3)
    rng = np.random.default_rng(2)
    pages = 12
    src_all, dst_all = pick(rng, pages), pick(rng, pages)
    prefix = 2
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: dst_all, INDEX: dst_all[prefix:], DENSE: dst_all})
    watch = dst.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id),
                                   timeout=30)
    first = (await watch.read()).status
    chunks = [(0, 5), (5, 9)]
    for start, end in chunks:
        reply = await part(src, request_id, {MAIN: src_all[start:end]}, offsets={MAIN: start}, last=False)
        assert reply.status.state == pb.TRANSFER_STATE_TRANSFERRING
    aux = bytes(range(256)) * 8
    last = await part(src, request_id, {MAIN: src_all[9:], INDEX: src_all[prefix:], DENSE: src_all},
                      offsets={MAIN: 9}, aux=aux)
    assert last.status.state == pb.TRANSFER_STATE_SUCCEEDED and last.status.parts == 3
    assert last.status.pages == pages + (pages - prefix) + pages
    updates = [first] + await rest(watch)
    assert [u.state for u in updates][0] == pb.TRANSFER_STATE_PENDING
    assert [u.parts for u in updates if u.state == pb.TRANSFER_STATE_TRANSFERRING] == [1, 2]
    assert all(u.aux == b"" for u in updates[:-1]) and updates[-1].aux == aux
    assert updates[-1].state == pb.TRANSFER_STATE_SUCCEEDED and updates[-1].parts == 3
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_all, dst_all), (INDEX, src_all[prefix:],
                                                                                   dst_all[prefix:]),
                                                       (DENSE, src_all, dst_all)]))


async def test_a_grant_with_src_offset_takes_the_senders_suffix_and_leaves_the_prefix_alone(brokers, engines,
                                                                                           request_id):
    """vLLM's order: prefill sends every page of the request, decode granted only what its prefix
    cache lacks and says from which of the sender's pages (src_offset); the held prefix is not written."""
    src, dst = await m3_pair(brokers, engines, seed=6)
    rng = np.random.default_rng(6)
    pages, held = 12, 5
    src_all, dst_new = pick(rng, pages), pick(rng, pages - held)
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: dst_new, INDEX: dst_new}, src_offsets={MAIN: held, INDEX: held})
    first = await part(src, request_id, {MAIN: src_all[:4]}, last=False)  # all of it before the offset
    assert first.status.state == pb.TRANSFER_STATE_TRANSFERRING
    last = await part(src, request_id, {MAIN: src_all[4:], INDEX: src_all}, offsets={MAIN: 4})
    assert last.status.state == pb.TRANSFER_STATE_SUCCEEDED and last.status.pages == 2 * (pages - held)
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_all[held:], dst_new),
                                                       (INDEX, src_all[held:], dst_new)]))


async def test_a_src_offset_is_refused_where_no_sender_is_named_and_past_the_request_bound(brokers, engines,
                                                                                          request_id):
    src, dst = await m3_pair(brokers, engines, seed=7)
    claimed = await refusal(dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, expiry_ms=10_000,
        pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2], src_offset=3)])))
    assert claimed.code() is grpc.StatusCode.INVALID_ARGUMENT and "sender_address" in claimed.details()
    huge = await refusal(offer(dst, src, request_id, {MAIN: [1, 2]}, src_offsets={MAIN: 1 << 31}))
    assert huge.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pages[0].src_offset (MAIN_KV)" in huge.details() and "max_pages_per_request" in huge.details()


async def test_parts_sent_at_once_land_once_each(brokers, engines, request_id):
    src, dst = await m3_pair(brokers, engines, seed=4)
    rng = np.random.default_rng(4)
    src_all, dst_all = pick(rng, 16), pick(rng, 16)
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: dst_all})
    parts = [part(src, request_id, {MAIN: src_all[i:i + 4]}, offsets={MAIN: i}, last=False) for i in (0, 4, 8)]
    await asyncio.gather(*parts)
    await part(src, request_id, {MAIN: src_all[12:]}, offsets={MAIN: 12})
    seen = await watch_all(dst, request_id)
    assert seen[-1].state == pb.TRANSFER_STATE_SUCCEEDED and seen[-1].parts == 4 and seen[-1].pages == 16
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_all, dst_all)]))


async def test_a_transfer_before_the_offer_waits_for_it(brokers, engines, request_id):
    src, dst = await m3_pair(brokers, engines, seed=5)
    ids = np.arange(6)
    sending = asyncio.create_task(part(src, request_id, {MAIN: ids}))
    await offer(dst, src, request_id, {MAIN: ids + 10}, sender_engine=False)
    reply = await asyncio.wait_for(sending, 30)
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED


async def test_refused_parts_write_nothing_and_leave_the_grant_to_complete(brokers, engines, request_id):
    src, dst = await m3_pair(brokers, engines, seed=6)
    rng = np.random.default_rng(6)
    src_all, dst_all = pick(rng, 8), pick(rng, 8)
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: dst_all, DENSE: dst_all})
    await part(src, request_id, {MAIN: src_all[:4]}, last=False)
    outside = await refusal(part(src, request_id, {MAIN: src_all[:1]}, offsets={MAIN: 8}, last=False))
    assert outside.code() == grpc.StatusCode.PERMISSION_DENIED and "rule part-in-grant" in outside.details()
    overlap = await refusal(part(src, request_id, {MAIN: src_all[:2]}, offsets={MAIN: 3}, last=False))
    assert overlap.code() == grpc.StatusCode.FAILED_PRECONDITION and "earlier part" in overlap.details()
    not_granted = await refusal(part(src, request_id, {INDEX: src_all[:2]}, last=False))
    assert not_granted.code() == grpc.StatusCode.PERMISSION_DENIED
    early_dense = await refusal(part(src, request_id, {MAIN: src_all[4:6], DENSE: src_all}, offsets={MAIN: 4},
                                     last=False))
    assert early_dense.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rule dense-kv-length" in early_dense.details() and "more_parts" in early_dense.details()
    short_dense = await refusal(part(src, request_id, {MAIN: src_all[4:], DENSE: src_all[:7]}, offsets={MAIN: 4}))
    assert short_dense.code() == grpc.StatusCode.FAILED_PRECONDITION and "rule dense-kv-length" in short_dense.details()
    big_aux = await refusal(part(src, request_id, {MAIN: src_all[4:], DENSE: src_all}, offsets={MAIN: 4},
                                 aux=b"x" * 65537))
    assert big_aux.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_aux_bytes" in big_aux.details()
    early_aux = await refusal(part(src, request_id, {MAIN: src_all[4:5]}, offsets={MAIN: 4}, last=False, aux=b"a"))
    assert early_aux.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a part for another receiver's offer (a decode told a stale id of its broker, say) names the one being written
    stray = await refusal(part(src, request_id, {MAIN: src_all[4:5]}, offsets={MAIN: 4}, last=False,
                               receiver="decode-gone"))
    assert stray.code() == grpc.StatusCode.FAILED_PRECONDITION, stray.details()
    assert "receiver_broker_id" in stray.details() and f"'{brokers.decode.process.broker_id}'" in stray.details()
    assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_TRANSFERRING
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_all[:4], dst_all[:4])]))
    done = await part(src, request_id, {MAIN: src_all[4:], DENSE: src_all}, offsets={MAIN: 4})
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    after = await refusal(part(src, request_id, {MAIN: src_all[:1]}, last=False))
    assert after.code() == grpc.StatusCode.FAILED_PRECONDITION and "completed already" in after.details()
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_all, dst_all), (DENSE, src_all, dst_all)]))


async def test_a_per_component_grant_cannot_be_claimed(brokers, engines, request_id):
    """The claimed flow (sender names the receiver) cannot write a grant offered to a sender."""
    src, dst = await m3_pair(brokers, engines, seed=7)
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: np.arange(4)}, sender_engine=False)  # no sender record yet
    error = await refusal(src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, peer_address=dst.broker.peer_address,
        remote_engine_id=dst.engine_id, components=[MAIN], src_page_ids=[0, 1, 2, 3]), timeout=30))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "offered" in error.details()
    assert_bytes(dst, before)


async def test_pages_per_component_need_a_sender(brokers, engines, request_id):
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    error = await refusal(dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id,
        pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2])]), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "sender_address" in error.details()
