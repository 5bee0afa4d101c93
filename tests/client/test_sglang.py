"""The SGLang adapter: KVArgs-shaped objects (MHA, MLA, MiniMax dense + sparse index K) on real brokers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch

from kvbroker_client import (
    BufferRole,
    Cancelled,
    Component,
    FailedPrecondition,
    KvDtype,
    Layout,
    SharedMemoryRef,
    Topology,
    TransferState,
    Unimplemented,
)
from kvbroker_client.tensors import SharedPool
from kvbroker_sglang import KVPoll, SGLangEngine, engine_components, kv_poll
from tests.client.conftest import CANARY, Pools, assert_pool_equals, expected_destination, fragmented, unique

ON_SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")


class StateType(str, enum.Enum):  # noqa: UP042 -- as upstream declares it
    """Members of upstream's sglang.srt.disaggregation.base.conn.StateType used here (a str enum there too)."""

    MAMBA = "mamba"
    MINIMAX_INDEX_K = "minimax_index_k"


class KVArgs:
    """The attributes of upstream's KVArgs that the adapter reads, set the way SGLang sets them."""

    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    state_types: list
    state_data_ptrs: list[list[int]]
    state_data_lens: list[list[int]]
    state_item_lens: list[list[int]]


@dataclass
class Rank:
    """One SGLang rank's cache in a SharedPool, described by its KVArgs."""

    kv_args: KVArgs
    pool: SharedPool
    topology: Topology
    attention: str
    tensors: list[torch.Tensor]  # every buffer behind the pointers, main KV then index
    index_layer_ids: list[int] | None = None


NUM_PAGES, PAGE_SIZE = 24, 4


def _token_buffers(pool: SharedPool, count: int, heads: int, head_dim: int, dtype) -> list[torch.Tensor]:
    # upstream pools index by token: [num_tokens, heads, head_dim], PAGE_SIZE tokens a page
    return [pool.torch((NUM_PAGES * PAGE_SIZE, heads, head_dim), dtype) for _ in range(count)]


def _infos(buffers: list[torch.Tensor]) -> tuple[list[int], list[int], list[int]]:
    return ([b.data_ptr() for b in buffers], [b.nbytes for b in buffers],
            [b[0].nbytes * PAGE_SIZE for b in buffers])


def make_rank(pools: Pools, model: str, *, fill: str, seed: int = 0, start_layer: int = 0, **topology) -> Rank:
    pool = pools.make(4 << 20, fill=fill, seed=seed)
    kv_args = KVArgs()
    kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [], [], [], []
    layers = 4 if model != "minimax" else 7
    index_layer_ids = None
    if model == "mla":  # MLATokenToKVPool: one latent buffer per layer (kv_lora_rank + rope)
        buffers = _token_buffers(pool, layers, 1, 48, torch.bfloat16)
        attention = "mla"
    else:  # MHATokenToKVPool: the K buffers of every layer, then the V buffers
        k = _token_buffers(pool, layers, 2, 16, torch.bfloat16)
        v = _token_buffers(pool, layers, 2, 16, torch.bfloat16)
        buffers = k + v
        attention = "mha"
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = _infos(buffers)
    if model == "minimax":  # MiniMaxSparseKVPool.get_index_k_state_buf_infos: K-only, one per sparse layer
        index_layer_ids = [start_layer + i for i in (3, 4, 5, 6)]
        index = _token_buffers(pool, len(index_layer_ids), 1, 32, torch.float8_e4m3fn)
        buffers = buffers + index
        ptrs, lens, items = _infos(index)
        kv_args.state_types.append(StateType.MINIMAX_INDEX_K)
        kv_args.state_data_ptrs.append(ptrs)
        kv_args.state_data_lens.append(lens)
        kv_args.state_item_lens.append(items)
    fields = dict(page_size=PAGE_SIZE, start_layer=start_layer, end_layer=start_layer + layers,
                  kv_dtype=KvDtype.BFLOAT16)
    fields.update(topology)
    return Rank(kv_args, pool, Topology(**fields), attention, buffers, index_layer_ids)


def adapter(client, rank: Rank, role: str) -> SGLangEngine:
    return SGLangEngine(client, unique(role), rank.kv_args, rank.topology, rank.pool,
                        index_layer_ids=rank.index_layer_ids)


# -- KVArgs to components --------------------------------------------------------------------------
def test_kv_poll_numbers_are_upstreams():
    assert [(p.name, p.value) for p in KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3), ("Success", 4)]
    assert [kv_poll(s) for s in (None, *TransferState)] == [
        KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success, KVPoll.Failed]


def test_mha_pointers_become_k_then_v_buffers_of_the_global_layers(pools):
    rank = make_rank(pools, "mha", fill="canary", start_layer=8, pp_size=2, pp_rank=1)
    (main,) = engine_components(rank.kv_args, rank.topology, rank.pool)
    assert (main.component, main.layout, main.num_pages) == (Component.MAIN_KV, Layout.KV_SPLIT, NUM_PAGES)
    keys = [(b.layer_id, b.role) for b in main.layer_buffers]
    assert keys == [(layer, BufferRole.K) for layer in range(8, 12)] + [(layer, BufferRole.V) for layer in range(8, 12)]
    base = rank.pool.bytes.__array_interface__["data"][0]
    for buffer, ptr, item_len in zip(main.layer_buffers, rank.kv_args.kv_data_ptrs, rank.kv_args.kv_item_lens):
        assert buffer.memory == SharedMemoryRef(rank.pool.name, ptr - base)
        assert buffer.item_len == item_len == PAGE_SIZE * 2 * 16 * 2


def test_mla_pointers_become_one_flat_buffer_per_layer(pools):
    rank = make_rank(pools, "mla", fill="canary")
    (main,) = engine_components(rank.kv_args, rank.topology, rank.pool)
    assert (main.layout, [(b.layer_id, b.role) for b in main.layer_buffers]) == (
        Layout.FLAT, [(layer, BufferRole.FLAT) for layer in range(4)])


def test_minimax_index_state_becomes_the_index_k_component_on_the_sparse_layers(pools):
    rank = make_rank(pools, "minimax", fill="canary")
    main, index = engine_components(rank.kv_args, rank.topology, rank.pool, index_layer_ids=rank.index_layer_ids)
    assert (main.layout, len(main.layer_buffers)) == (Layout.KV_SPLIT, 14)
    assert (index.component, index.layout, index.num_pages) == (Component.MINIMAX_INDEX_K, Layout.FLAT, NUM_PAGES)
    assert [b.layer_id for b in index.layer_buffers] == [3, 4, 5, 6]
    assert {b.item_len for b in index.layer_buffers} == {PAGE_SIZE * 32}


def test_pointer_count_that_fits_neither_mha_nor_mla_is_refused(pools):
    rank = make_rank(pools, "mha", fill="canary", end_layer=3)
    with pytest.raises(ValueError, match="fit neither MHA"):
        engine_components(rank.kv_args, rank.topology, rank.pool)


def test_pointer_outside_the_given_segments_is_refused(pools):
    rank = make_rank(pools, "mla", fill="canary")
    elsewhere = torch.zeros(NUM_PAGES * PAGE_SIZE, 1, 48, dtype=torch.bfloat16)
    rank.kv_args.kv_data_ptrs[2] = elsewhere.data_ptr()
    with pytest.raises(ValueError, match="layer 2 FLAT.*no known shared-memory segment"):
        engine_components(rank.kv_args, rank.topology, rank.pool)


def test_state_type_without_a_component_is_refused(pools):
    rank = make_rank(pools, "minimax", fill="canary")
    rank.kv_args.state_types = [StateType.MAMBA]
    with pytest.raises(ValueError, match="'mamba' has no kvbroker component"):
        engine_components(rank.kv_args, rank.topology, rank.pool, index_layer_ids=rank.index_layer_ids)


def test_index_state_needs_the_sparse_layer_ids(pools):
    rank = make_rank(pools, "minimax", fill="canary")
    with pytest.raises(ValueError, match="needs index_layer_ids"):
        engine_components(rank.kv_args, rank.topology, rank.pool)


# -- requests through the adapter on real brokers ----------------------------------------------------
@pytest.mark.integration
@ON_SESSION_LOOP
@pytest.mark.parametrize("model", ["mha", "mla", "minimax"])
async def test_request_moves_every_page_and_polls_like_sglang(model, prefill_client, decode_client, pools):
    src_rank = make_rank(pools, model, fill="random", seed=5)
    dst_rank = make_rank(pools, model, fill="canary")
    prefill, decode = adapter(prefill_client, src_rank, "prefill"), adapter(decode_client, dst_rank, "decode")
    await prefill.register()
    await decode.register()
    expected_components = {Component.MAIN_KV} | ({Component.MINIMAX_INDEX_K} if model == "minimax" else set())
    assert set(decode.transferable) == expected_components
    room = 4242
    assert decode.poll(room) is prefill.poll(room) is KVPoll.Bootstrapping

    rng = np.random.default_rng(9)
    src_pages = fragmented(rng, NUM_PAGES, 13).astype(np.int32)  # SGLang's kv page indices are int32
    dst_pages = fragmented(rng, NUM_PAGES, 13).astype(np.int32)
    before = dst_rank.pool.bytes.copy()
    await decode.expect(room, dst_pages)
    assert decode.poll(room) is KVPoll.WaitingForInput
    peer = (await decode_client.info()).peer_address
    sent = await prefill.send(room, torch.from_numpy(src_pages), peer_address=peer,
                              remote_engine_id=decode.engine_id)
    received = await decode.wait(room, timeout=30)

    assert sent.pages == received.pages == 13
    assert set(received.components) == expected_components
    assert decode.poll(room) is prefill.poll(room) is KVPoll.Success
    assert decode.failure(room) is None
    for src_buffer, dst_buffer in zip(src_rank.tensors, dst_rank.tensors):  # page by page, as SGLang reads them
        src_bytes = src_buffer.view(torch.uint8).view(NUM_PAGES, -1)
        dst_bytes = dst_buffer.view(torch.uint8).view(NUM_PAGES, -1)
        assert torch.equal(dst_bytes[dst_pages], src_bytes[src_pages])
    assert_pool_equals(dst_rank.pool, expected_destination(
        src_rank.pool, dst_rank.pool, before, prefill.components, decode.components, src_pages, dst_pages))
    await prefill.unregister()
    await decode.unregister()


@pytest.mark.integration
@ON_SESSION_LOOP
async def test_aborted_request_polls_failed_with_its_typed_failure(decode_client, pools):
    decode = adapter(decode_client, make_rank(pools, "mha", fill="canary"), "decode")
    await decode.register()
    await decode.expect(7, np.arange(4, dtype=np.int32))
    await decode.abort(7, "request aborted by the router")
    with pytest.raises(Cancelled, match="aborted by the router"):
        await decode.wait(7, timeout=30)
    assert decode.poll(7) is KVPoll.Failed
    assert decode.failure(7).code is grpc.StatusCode.CANCELLED
    decode.forget(7)
    assert decode.poll(7) is KVPoll.Bootstrapping
    await decode.unregister()


@pytest.mark.integration
@ON_SESSION_LOOP
async def test_minimax_with_pipeline_parallel_fails_both_sides_before_any_byte(prefill_client, decode_client,
                                                                               pools):
    src_rank = make_rank(pools, "minimax", fill="random", pp_size=2)
    dst_rank = make_rank(pools, "minimax", fill="canary", pp_size=2)
    prefill, decode = adapter(prefill_client, src_rank, "prefill"), adapter(decode_client, dst_rank, "decode")
    await prefill.register()
    await decode.register()
    await decode.expect(11, np.arange(6, dtype=np.int32))
    peer = (await decode_client.info()).peer_address
    with pytest.raises(FailedPrecondition, match="PP>1"):
        await prefill.send(11, np.arange(6, dtype=np.int32), peer_address=peer, remote_engine_id=decode.engine_id)
    with pytest.raises(FailedPrecondition, match="PP>1"):
        await decode.wait(11, timeout=30)
    assert prefill.poll(11) is decode.poll(11) is KVPoll.Failed
    assert (dst_rank.pool.bytes == CANARY).all()
    await prefill.unregister()
    await decode.unregister()


@pytest.mark.integration
@ON_SESSION_LOOP
async def test_index_with_value_state_is_refused_by_the_broker_as_unimplemented(prefill_client, pools):
    rank = make_rank(pools, "minimax", fill="canary")
    rank.kv_args.state_types = ["minimax_index_kv"]
    engine = adapter(prefill_client, rank, "prefill")
    with pytest.raises(Unimplemented, match="MINIMAX_INDEX_KV"):
        await engine.register()
