"""Layer buffers from arrays and tensors: SharedPool, SegmentMap, and a transfer registered from torch tensors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvbroker_client import (
    BufferRole,
    Component,
    CudaIpcRef,
    KvDtype,
    Layout,
    SharedMemoryRef,
    Topology,
    TransferState,
)
from kvbroker_client.tensors import (
    SegmentMap,
    SharedPool,
    flat_component,
    kv_dtype,
    kv_split_component,
    layer_buffer,
    memory_ref,
)
from tests.support.pools import CANARY, assert_pool_equals, expected_destination, fragmented, unique

ON_SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def pool():
    with SharedPool(1 << 20, prefix="kvbct") as made:
        yield made


def test_pool_hands_out_aligned_disjoint_regions(pool):
    a = pool.numpy((10, 3), np.float16)
    b = pool.torch((5, 7), torch.bfloat16)
    c = pool.numpy(100)
    offsets = [pool.ref(x).offset for x in (a, b, c)]
    assert offsets == [0, 4096, 8192]
    assert (a.shape, a.dtype, tuple(b.shape), b.dtype) == ((10, 3), np.float16, (5, 7), torch.bfloat16)
    b.view(torch.uint8).fill_(7)
    assert (pool.bytes[4096:4096 + 70] == 7).all() and (pool.bytes[4096 + 70:8192] == 0).all()


def test_pool_refuses_an_allocation_past_its_end(pool):
    pool.numpy(pool.size - 4096)
    with pytest.raises(MemoryError, match="cannot allocate"):
        pool.numpy(4097)


def test_layer_buffer_of_a_tensor_is_its_segment_offset_and_one_page(pool):
    pool.numpy(100)
    t = pool.torch((32, 4, 2, 8), torch.bfloat16)  # [num_pages, page_size, heads, head_dim]
    buffer = layer_buffer(t, 5, BufferRole.K, segments=pool)
    assert buffer.memory == SharedMemoryRef(pool.name, 4096)
    assert (buffer.length, buffer.item_len, buffer.num_pages) == (t.nbytes, t[0].nbytes, 32)
    assert (buffer.layer_id, buffer.role) == (5, BufferRole.K)


def test_item_len_can_be_given_for_token_indexed_buffers(pool):
    t = pool.torch((64, 2, 8), torch.float16)  # SGLang style: [tokens, heads, head_dim], 4 tokens a page
    buffer = layer_buffer(t, 0, segments=pool, item_len=t[0].nbytes * 4)
    assert (buffer.item_len, buffer.num_pages) == (128, 16)


def test_kv_split_and_flat_components_from_numpy_arrays(pool):
    k = [pool.numpy((16, 32)) for _ in range(2)]
    v = [pool.numpy((16, 32)) for _ in range(2)]
    index = [pool.numpy((16, 8))]
    main = kv_split_component(k, v, segments=pool, start_layer=4)
    sparse = flat_component(index, layer_ids=[5], segments=pool, component="minimax_index_k")
    assert (main.component, main.layout, main.num_pages) == (Component.MAIN_KV, Layout.KV_SPLIT, 16)
    assert [(b.layer_id, b.role) for b in main.layer_buffers] == [
        (4, BufferRole.K), (4, BufferRole.V), (5, BufferRole.K), (5, BufferRole.V)]
    assert [b.memory.offset for b in main.layer_buffers] == [0, 2 * 4096, 4096, 3 * 4096]
    assert (sparse.component, sparse.layout, sparse.layer_buffers[0].item_len) == (
        Component.MINIMAX_INDEX_K, Layout.FLAT, 8)


def test_segment_map_resolves_addresses_in_any_of_its_segments(pool):
    with SharedPool(8192, prefix="kvbct") as other:
        x = other.numpy(16)
        segments = SegmentMap([pool, other.segment])
        address = x.__array_interface__["data"][0]
        assert segments.resolve(address + 3, 10) == SharedMemoryRef(other.name, 3)
        with pytest.raises(ValueError, match="runs past the end"):
            segments.resolve(address, 8193)


def test_non_contiguous_tensor_is_refused(pool):
    t = pool.torch((8, 8), torch.float32)
    with pytest.raises(ValueError, match="not contiguous"):
        layer_buffer(t.t(), 0, segments=pool)


def test_tensor_outside_shared_memory_is_refused_with_a_hint(pool):
    with pytest.raises(ValueError, match="no known shared-memory segment.*SharedPool"):
        memory_ref(torch.zeros(16, 4), pool)


def test_non_cpu_tensor_is_refused(pool):
    with pytest.raises(ValueError, match="only CPU tensors"):
        memory_ref(torch.empty(4, 4, device="meta"), pool)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC export needs a CUDA device (CPU torch here)")
def test_cuda_tensor_resolves_to_its_allocation_handle_and_offset(pool):
    whole = torch.zeros(64, 16, dtype=torch.uint8, device="cuda")
    ref = memory_ref(whole[8:], pool)  # the segment map is not consulted for GPU memory
    assert isinstance(ref, CudaIpcRef) and len(ref.handle) == 64
    assert ref.device == whole.device.index
    assert ref.offset == memory_ref(whole, pool).offset + 8 * 16
    assert ref.offset + 56 * 16 <= ref.allocation_size


def test_tensor_shared_by_torch_with_file_descriptors_is_refused_with_a_hint():
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    try:
        t = torch.zeros(8, 8).share_memory_()
        with pytest.raises(ValueError, match="file_system"):
            memory_ref(t)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def test_kv_dtype_names_torch_and_numpy_dtypes():
    assert kv_dtype(torch.bfloat16) is KvDtype.BFLOAT16
    assert kv_dtype(torch.float8_e4m3fn) is KvDtype.FLOAT8_E4M3
    assert kv_dtype(np.float16) is KvDtype.FLOAT16
    assert kv_dtype(np.dtype("uint8")) is KvDtype.UINT8
    with pytest.raises(ValueError, match="no kvbroker KvDtype"):
        kv_dtype(torch.complex64)


def test_importing_the_client_does_not_import_torch():
    code = ("import sys, kvbroker_client, kvbroker_client.tensors, kvbroker_client.client; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.integration
@ON_SESSION_LOOP
async def test_transfer_between_engines_registered_from_torch_tensors(prefill_client, decode_client, pools):
    layers, sparse, num_pages, page_size = 3, [1, 2], 32, 4
    sides = []
    for fill in ("random", "canary"):
        pool = pools.make(1 << 20, fill=fill, seed=3)
        k = [pool.torch((num_pages, page_size, 2, 8), torch.bfloat16) for _ in range(layers)]
        v = [pool.torch((num_pages, page_size, 2, 8), torch.bfloat16) for _ in range(layers)]
        index = [pool.torch((num_pages, page_size, 16), torch.float8_e4m3fn) for _ in sparse]
        components = [kv_split_component(k, v, segments=pool),
                      flat_component(index, layer_ids=sparse, segments=pool, component=Component.MINIMAX_INDEX_K)]
        sides.append((pool, components))
    (src_pool, src_components), (dst_pool, dst_components) = sides
    topology = Topology(page_size=page_size, start_layer=0, end_layer=layers, kv_dtype=kv_dtype(torch.bfloat16))
    src_id, dst_id, rid = unique("prefill"), unique("decode"), unique("req")
    await prefill_client.register_engine(src_id, topology, src_components)
    await decode_client.register_engine(dst_id, topology, dst_components)
    rng = np.random.default_rng(11)
    src_ids, dst_ids = fragmented(rng, num_pages, 17), fragmented(rng, num_pages, 17)
    before = dst_pool.bytes.copy()
    assert (before == CANARY).all()
    both = (Component.MAIN_KV, Component.MINIMAX_INDEX_K)
    await decode_client.expect_transfer(dst_id, rid, dst_page_ids=dst_ids, components=both)
    peer = (await decode_client.info()).peer_address
    await prefill_client.transfer(src_id, rid, peer, dst_id, src_ids, components=both)
    assert (await decode_client.wait(dst_id, rid, timeout=30)).state is TransferState.SUCCEEDED
    assert_pool_equals(dst_pool, expected_destination(src_pool, dst_pool, before, src_components, dst_components,
                                                      src_ids, dst_ids))


@pytest.mark.integration
@ON_SESSION_LOOP
async def test_transfer_from_a_tensor_torch_shared_by_file_name(prefill_client, decode_client, pools):
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        src = torch.randint(0, 256, (16, 64), dtype=torch.uint8).share_memory_()
        src_buffer = layer_buffer(src, 0)
        assert src_buffer.memory.name.startswith("torch_")
        dst_pool = pools.make(1 << 16, fill="canary")
        dst = dst_pool.numpy((16, 64))
        topology = Topology(page_size=1, start_layer=0, end_layer=1, kv_dtype=KvDtype.UINT8)
        src_id, dst_id, rid = unique("prefill"), unique("decode"), unique("req")
        await prefill_client.register_engine(src_id, topology, [flat_component([src])])
        await decode_client.register_engine(dst_id, topology, [flat_component([dst], segments=dst_pool)])
        await decode_client.expect_transfer(dst_id, rid, dst_page_ids=[9, 3])
        peer = (await decode_client.info()).peer_address
        await prefill_client.transfer(src_id, rid, peer, dst_id, [0, 15])
        await decode_client.wait(dst_id, rid, timeout=30)
        assert (dst[9] == src[0].numpy()).all() and (dst[3] == src[15].numpy()).all()
        untouched = np.ones(16, bool)
        untouched[[3, 9]] = False
        assert (dst[untouched] == CANARY).all()
        await prefill_client.unregister_engine(src_id)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
