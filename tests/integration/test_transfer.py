"""Two real brokers, a real transfer engine, real bytes: transfers and the refusals before them."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import ALL, SMALL, assert_bytes, expected_after
from tests.support.flows import grant, transfer, watch_all, watch_first

pytestmark = pytest.mark.integration

INDEX_K = [pb.COMPONENT_MINIMAX_INDEX_K]
MAIN_KV = [pb.COMPONENT_MAIN_KV]


async def roundtrip(brokers, engines, request_id, components, *, layout="KV_SPLIT", src_comps=None, seed=0):
    names = src_comps or ("MAIN_KV", "MINIMAX_INDEX_K")
    src = await engines.make(brokers.prefill, "prefill", components=names, main_layout=layout, seed=seed)
    dst = await engines.make(brokers.decode, "decode", components=names, main_layout=layout, fill="canary")
    rng = np.random.default_rng(seed)
    src_ids = rng.permutation(SMALL.num_pages)[: SMALL.request_pages]
    dst_ids = rng.permutation(SMALL.num_pages)[: SMALL.request_pages]
    before = dst.segment.array.copy()
    await grant(dst, request_id, dst_ids, components)
    watch = dst.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id),
                                   timeout=30)
    seen = [(await watch.read()).status]  # subscribed (and PENDING seen) before the transfer starts
    reply = await transfer(src, dst, request_id, src_ids, components)
    while (update := await watch.read()) is not grpc.aio.EOF:
        seen.append(update.status)
    assert_bytes(dst, expected_after(src, dst, before, components, src_ids, dst_ids))
    return reply.status, seen


async def test_index_k_transfer_alone_moves_only_index_pages(brokers, engines, request_id):
    status, seen = await roundtrip(brokers, engines, request_id, INDEX_K)
    assert status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert status.pages == SMALL.request_pages
    assert status.bytes == SMALL.request_pages * SMALL.index_item_len * SMALL.sparse_layers
    assert seen[-1].state == pb.TRANSFER_STATE_SUCCEEDED


async def test_main_kv_kv_split_transfer(brokers, engines, request_id):
    status, _ = await roundtrip(brokers, engines, request_id, MAIN_KV, src_comps=("MAIN_KV",), seed=1)
    assert status.bytes == SMALL.request_pages * SMALL.kv_item_len * 2 * SMALL.layers


async def test_main_kv_flat_transfer(brokers, engines, request_id):
    status, _ = await roundtrip(brokers, engines, request_id, MAIN_KV, layout="FLAT", src_comps=("MAIN_KV",),
                                seed=2)
    assert status.bytes == SMALL.request_pages * SMALL.kv_item_len * 2 * SMALL.layers


async def test_main_kv_and_index_k_move_together_with_one_page_list(brokers, engines, request_id):
    status, seen = await roundtrip(brokers, engines, request_id, ALL, seed=3)
    assert status.bytes == SMALL.request_bytes()
    assert [s.state for s in seen] == [pb.TRANSFER_STATE_PENDING, pb.TRANSFER_STATE_TRANSFERRING,
                                       pb.TRANSFER_STATE_SUCCEEDED]
    assert seen[-1].pages == SMALL.request_pages and seen[-1].bytes == status.bytes


async def test_contiguous_pages_coalesce_into_one_run(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, range(10, 30))
    reply = await transfer(src, dst, request_id, range(40, 60))
    assert (reply.status.pages, reply.status.runs) == (20, 1)
    assert_bytes(dst, expected_after(src, dst, before, ALL, range(40, 60), range(10, 30)))


async def test_unequal_page_lists_are_truncated(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, [5, 6, 7])
    reply = await transfer(src, dst, request_id, [1, 2, 3, 9, 11])
    # Source pages past the grant's list are dropped, and not counted: truncated_pages counts grant
    # entries left unfilled (tests/integration/test_counters.py), and this grant is full.
    assert reply.status.truncated_pages == 0 and reply.status.pages == 3
    assert_bytes(dst, expected_after(src, dst, before, ALL, [1, 2, 3], [5, 6, 7]))


async def test_transfer_to_explicit_dst_pages_inside_the_grant(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, [4, 8, 9, 12])
    await transfer(src, dst, request_id, [0, 1], dst_ids=[9, 12])
    assert_bytes(dst, expected_after(src, dst, before, ALL, [0, 1], [9, 12]))


# -- refusals: each reaches the caller with its code and writes nothing ------------------------------

async def refused(brokers, engines, request_id, *, src_topology=None, dst_topology=None, dst_shape=SMALL,
                  components=ALL, grant_ids=range(8), src_ids=range(8), dst_ids=(), src_names=None,
                  dst_names=None):
    names = ("MAIN_KV", "MINIMAX_INDEX_K")
    src = await engines.make(brokers.prefill, "prefill", components=src_names or names, **(src_topology or {}))
    dst = await engines.make(brokers.decode, "decode", dst_shape, components=dst_names or names, fill="canary",
                             **(dst_topology or {}))
    before = dst.segment.array.copy()
    await grant(dst, request_id, grant_ids, components)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, src_ids, components, dst_ids)
    assert np.array_equal(dst.segment.array, before), "a refused transfer wrote into the receiver"
    return info.value, dst


async def test_index_k_transfer_rejects_pp_above_one_on_sender(brokers, engines, request_id):
    error, dst = await refused(brokers, engines, request_id, components=INDEX_K,
                               src_topology=dict(pp_size=2, pp_rank=0))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "PP>1 not supported for MiniMax sparse index" in error.details()
    final = (await watch_all(dst, request_id))[-1]
    assert final.state == pb.TRANSFER_STATE_FAILED and "PP>1" in final.reason


async def test_index_k_transfer_rejects_pp_above_one_on_receiver(brokers, engines, request_id):
    error, _ = await refused(brokers, engines, request_id, components=INDEX_K,
                             dst_topology=dict(pp_size=4, pp_rank=1))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "receiver pp_size=4" in error.details()


async def test_index_k_transfer_rejects_heterogeneous_attention_tp(brokers, engines, request_id):
    error, _ = await refused(brokers, engines, request_id, components=INDEX_K,
                             src_topology=dict(attn_tp_size=2, attn_tp_rank=1, tp_size=2, tp_rank=1))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "heterogeneous TP" in error.details() and "rule index-k-attn-tp" in error.details()


async def test_main_kv_alone_is_not_bound_by_the_index_pp_rule(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", pp_size=2, pp_rank=0)
    dst = await engines.make(brokers.decode, "decode", fill="canary", pp_size=2, pp_rank=0)
    await grant(dst, request_id, range(4), MAIN_KV)
    reply = await transfer(src, dst, request_id, range(4), MAIN_KV)
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED


@pytest.mark.parametrize("topology, words", [
    (dict(page_size=8), "page_size differs"),
    (dict(kv_dtype=pb.KV_DTYPE_FLOAT16), "kv_dtype differs"),
])
async def test_transfer_rejects_mismatched_cache_shape(brokers, engines, request_id, topology, words):
    error, _ = await refused(brokers, engines, request_id, dst_topology=topology)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and words in error.details()


async def test_transfer_rejects_mismatched_item_len(brokers, engines, request_id):
    wider = SMALL.__class__(**{**SMALL.__dict__, "head_dim": 64})
    error, _ = await refused(brokers, engines, request_id, dst_shape=wider)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "item_len differs" in error.details()


async def test_transfer_rejects_mismatched_layer_ids(brokers, engines, request_id):
    fewer = SMALL.__class__(**{**SMALL.__dict__, "dense_layers": 2})
    error, _ = await refused(brokers, engines, request_id, dst_shape=fewer)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "layer ids differ" in error.details()


async def test_transfer_rejects_component_missing_on_receiver(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", components=("MAIN_KV",), fill="canary")
    await grant(dst, request_id, range(4), MAIN_KV)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, range(4), ALL)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "MINIMAX_INDEX_K is not registered by receiver" in info.value.details()


async def test_pages_outside_the_grant_are_permission_denied(brokers, engines, request_id):
    error, dst = await refused(brokers, engines, request_id, grant_ids=[1, 2, 3], src_ids=[0, 1],
                               dst_ids=[3, 40])
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "page 40 is outside the grant" in error.details()
    assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING  # the grant still stands


async def test_components_outside_the_grant_are_permission_denied(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, range(4), INDEX_K)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, range(4), ALL)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "MAIN_KV not in the grant" in info.value.details()
    assert np.array_equal(dst.segment.array, before)


async def test_a_grant_is_claimed_only_once(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await grant(dst, request_id, range(4))
    await transfer(src, dst, request_id, range(4))
    before = dst.segment.array.copy()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, range(8, 12))
    assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
    assert np.array_equal(dst.segment.array, before)


async def test_transfer_without_a_grant_is_not_found(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, range(4))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no grant" in info.value.details()
    assert np.array_equal(dst.segment.array, before)


async def test_expired_grant_fails_watchers_and_refuses_late_transfer(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, range(4), expiry_ms=50)
    seen = await watch_all(dst, request_id)  # ends when the grant expires
    assert seen[-1].state == pb.TRANSFER_STATE_FAILED and "expired" in seen[-1].reason
    assert seen[-1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, range(4))
    assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)
    assert np.array_equal(dst.segment.array, before)


async def test_request_id_in_flight_is_already_exists(brokers, engines, request_id):
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await grant(dst, request_id, range(4))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grant(dst, request_id, range(4, 8))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_unknown_engine_is_not_found(brokers, request_id):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await brokers.prefill.stub.Transfer(bpb.TransferRequest(
            request_id=request_id, engine_id="nobody/tp0", peer_address=brokers.decode.peer_address,
            remote_engine_id="x", components=ALL, src_page_ids=[1]), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nobody/tp0" in info.value.details()


async def test_unknown_remote_engine_is_not_found(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await src.stub.Transfer(bpb.TransferRequest(
            request_id=request_id, engine_id=src.engine_id, peer_address=brokers.decode.peer_address,
            remote_engine_id="ghost/tp0", components=ALL, src_page_ids=[1]), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "ghost/tp0" in info.value.details()


async def test_unreachable_peer_is_unavailable(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await src.stub.Transfer(bpb.TransferRequest(
            request_id=request_id, engine_id=src.engine_id, peer_address="127.0.0.1:1",
            remote_engine_id="decode/tp0", components=ALL, src_page_ids=[1]), timeout=20)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "127.0.0.1:1" in info.value.details()


@pytest.mark.parametrize("field, ids, words", [
    ("src", [], "src_page_ids: at least one page id"),
    ("src", [3, SMALL.num_pages], f"src_page_ids[1]: page id {SMALL.num_pages} is out of range"),
])
async def test_bad_source_page_ids_are_invalid_argument(brokers, engines, request_id, field, ids, words):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await grant(dst, request_id, range(4))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await transfer(src, dst, request_id, ids)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


@pytest.mark.parametrize("ids, words", [
    ([], "dst_page_ids: at least one page id"),
    ([1, 2, 1], "dst_page_ids: page id 1 appears more than once"),
    ([SMALL.num_pages + 5], f"dst_page_ids[0]: page id {SMALL.num_pages + 5} is out of range"),
])
async def test_bad_grant_page_ids_are_invalid_argument(brokers, engines, request_id, ids, words):
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grant(dst, request_id, ids)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


async def test_cancel_a_grant_fails_its_watchers(brokers, engines, request_id):
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await grant(dst, request_id, range(4))
    watcher = asyncio.create_task(watch_all(dst, request_id))
    reply = await dst.stub.CancelTransfer(bpb.CancelTransferRequest(
        engine_id=dst.engine_id, request_id=request_id, reason="decode gave up"), timeout=10)
    assert reply.status.state == pb.TRANSFER_STATE_FAILED
    seen = await asyncio.wait_for(watcher, 10)
    assert seen[-1].state == pb.TRANSFER_STATE_FAILED and "decode gave up" in seen[-1].reason


async def test_watch_unknown_request_is_not_found(brokers, engines):
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await watch_all(dst, "never-granted")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
