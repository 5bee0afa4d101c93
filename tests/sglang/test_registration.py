"""SGLang's own pools (MiniMaxSparseKVPool with 3 dense + 4 sparse layers, MHA, MLA; CPU, in /dev/shm)
through SGLang's own KVArgs helpers, registered by kvbroker's manager with a real broker; and the
KVArgs that read as no layout, refused by name (kvbroker_sglang.layout)."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker_client import BrokerClient, BufferRole, Component, Layout, SharedMemoryRef
from kvbroker_client.adapter.memory import NotExportable
from kvbroker_sglang.layout import LayoutError, engine_components
from tests.support import sglang_ranks as ranks

pytestmark = pytest.mark.integration


def test_setup_state_kv_args_gives_index_k_then_dense_kv_with_no_layer_ids(sglang_process):
    from sglang.srt.disaggregation.base.conn import StateType

    rank = ranks.rank_kv_args(ranks.minimax_pool(1))
    kv_args = rank.kv_args
    assert kv_args.state_types == [StateType.MINIMAX_INDEX_K, StateType.MINIMAX_DENSE_KV]
    assert [len(p) for p in kv_args.state_data_ptrs] == [4, 6]
    assert len(kv_args.kv_data_ptrs) == 8 and kv_args.kv_layer_ids == []
    assert kv_args.state_layer_ids == [[], []]
    assert kv_args.kvbroker_pool.main_layers == tuple(ranks.SPARSE_LAYERS)  # recorded by the plugin's hook
    assert kv_args.kvbroker_pool.dense_layers == tuple(ranks.DENSE_LAYERS)


def test_the_index_with_value_pool_stays_refused_by_sglang(sglang_process):
    pool = ranks.minimax_pool(1, index_value=True)
    assert pool.index_kv_pool is not None
    with pytest.raises(NotImplementedError, match="index value"):
        ranks.rank_kv_args(pool)


async def test_the_manager_registers_three_components_with_their_layers(sglang_ranks, broker_pair):
    prefill, _ = broker_pair
    rank = ranks.rank_kv_args(ranks.minimax_pool(2))
    manager = await asyncio.to_thread(sglang_ranks.manager, prefill.listen, "decode", rank)
    async with BrokerClient(prefill.listen) as client:
        (engine,) = [e for e in (await client.info()).engines if e.engine_id == manager.engine_id]
    by_component = {c.component: c for c in engine.components}
    assert set(by_component) == {Component.MAIN_KV, Component.MINIMAX_INDEX_K, Component.MINIMAX_DENSE_KV}
    main, index, dense = (by_component[c] for c in (Component.MAIN_KV, Component.MINIMAX_INDEX_K,
                                                    Component.MINIMAX_DENSE_KV))
    assert (main.layout, len(main.layer_buffers)) == (Layout.KV_SPLIT, 8)
    assert sorted((b.layer_id, b.role) for b in main.layer_buffers) == sorted(
        (x, r) for x in ranks.SPARSE_LAYERS for r in (BufferRole.K, BufferRole.V))
    assert (index.layout, len(index.layer_buffers)) == (Layout.FLAT, 4)
    assert sorted(b.layer_id for b in index.layer_buffers) == ranks.SPARSE_LAYERS
    assert (dense.layout, len(dense.layer_buffers)) == (Layout.KV_SPLIT, 6)
    assert sorted({b.layer_id for b in dense.layer_buffers}) == ranks.DENSE_LAYERS
    pages = (ranks.POOL_TOKENS + ranks.PAGE_SIZE) // ranks.PAGE_SIZE
    assert main.num_pages == index.num_pages == dense.num_pages == pages
    assert engine.topology.page_size == ranks.PAGE_SIZE
    assert (engine.topology.start_layer, engine.topology.end_layer) == (0, 7)
    assert manager.broker_address == prefill.peer_listen


async def test_a_pool_in_private_memory_is_refused_before_anything_registers(sglang_ranks, broker_pair):
    prefill, _ = broker_pair
    import torch
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    pool = MiniMaxSparseKVPool(size=32, page_size=4, dtype=torch.bfloat16, head_num=1, head_dim=32, idx_head_dim=16,
                               dense_layer_ids=ranks.DENSE_LAYERS, sparse_layer_ids=ranks.SPARSE_LAYERS,
                               disable_value_sparse_layer_ids=ranks.SPARSE_LAYERS, device="cpu", start_layer=0,
                               end_layer=7)
    rank = ranks.rank_kv_args(pool)  # SGLang's own CPU pool: plain malloc'd tensors
    async with BrokerClient(prefill.listen) as client:
        before = (await client.info()).engine_ids
        with pytest.raises(NotExportable, match=r"kv_data_ptrs\[0\].*private host memory"):
            await asyncio.to_thread(sglang_ranks.manager, prefill.listen, "prefill", rank)
        assert (await client.info()).engine_ids == before


async def _registered(broker, manager):
    async with BrokerClient(broker.listen) as client:
        (engine,) = [e for e in (await client.info()).engines if e.engine_id == manager.engine_id]
    return engine


async def test_an_mha_pool_registers_k_then_v_of_its_global_layers(sglang_ranks, broker_pair):
    """A PP stage's MHA pool (layers 2..5 of 8): SGLang lists K of each layer, then V, and no layer ids."""
    prefill, _ = broker_pair
    rank = ranks.rank_kv_args(ranks.mha_pool(5, start_layer=2, end_layer=6), num_hidden_layers=8)
    assert len(rank.kv_args.kv_data_ptrs) == 8 and not rank.kv_args.state_types
    manager = await asyncio.to_thread(sglang_ranks.manager, prefill.listen, "prefill", rank)
    engine = await _registered(prefill, manager)
    (main,) = engine.components
    assert (main.component, main.layout) == (Component.MAIN_KV, Layout.KV_SPLIT)
    assert [(b.layer_id, b.role) for b in main.layer_buffers] == [
        *((x, BufferRole.K) for x in range(2, 6)), *((x, BufferRole.V) for x in range(2, 6))]
    assert [b.item_len for b in main.layer_buffers] == list(rank.kv_args.kv_item_lens)
    assert (engine.topology.start_layer, engine.topology.end_layer) == (2, 6)


async def test_an_mla_pool_registers_one_flat_latent_per_layer(sglang_ranks, broker_pair):
    prefill, _ = broker_pair
    rank = ranks.rank_kv_args(ranks.mla_pool(6, layers=4), num_hidden_layers=4)
    manager = await asyncio.to_thread(sglang_ranks.manager, prefill.listen, "decode", rank, is_mla=True)
    (main,) = (await _registered(prefill, manager)).components
    assert (main.component, main.layout) == (Component.MAIN_KV, Layout.FLAT)
    assert [(b.layer_id, b.role) for b in main.layer_buffers] == [(x, BufferRole.FLAT) for x in range(4)]


def _no_memory(ptrs, lens, what):
    return [SharedMemoryRef("unused", 0) for _ in ptrs]


def test_pointers_that_read_as_no_layout_are_refused_naming_the_list(sglang_process):
    rank = ranks.rank_kv_args(ranks.mha_pool(7, start_layer=0, end_layer=4), num_hidden_layers=4)
    rank.kv_args.kv_data_ptrs = rank.kv_args.kv_data_ptrs[:-1]  # 7 buffers for 4 layers
    with pytest.raises(LayoutError, match=r"kv_data_ptrs: 7 buffers.*need 8"):
        engine_components(rank.kv_args, _no_memory)


def test_a_state_type_without_a_component_is_refused_by_name(sglang_process):
    from sglang.srt.disaggregation.base.conn import StateType

    rank = ranks.rank_kv_args(ranks.minimax_pool(8))
    rank.kv_args.state_types = [StateType.MAMBA, *rank.kv_args.state_types[1:]]
    with pytest.raises(LayoutError, match=r"state_types\[0\]: SGLang state 'mamba' has no kvbroker component"):
        engine_components(rank.kv_args, _no_memory)
