"""SGLang's CPU KV pools, built by SGLang's own classes through the plugin's hook on SGLang's KV-cache
configurator (kvbroker_sglang.host_pools), are in /dev/shm from birth: every pointer KVArgs carries
resolves to a segment a broker can open, and the pools' own pointer caches point at the same bytes.
The end-to-end tests (test_end_to_end.py) move real bytes between such pools on both engines."""

from __future__ import annotations

import pkgutil

import numpy as np
import pytest
import torch

from kvbroker_client import SharedMemoryRef
from kvbroker_client.adapter.memory import MemoryExporter, NotExportable
from kvbroker_sglang import host_pools
from tests.support import sglang_ranks as ranks

pytestmark = pytest.mark.integration


def _segment_bytes(ref: SharedMemoryRef, n: int) -> bytes:
    with open(f"/dev/shm/{ref.name}", "rb") as f:
        f.seek(ref.offset)
        return f.read(n)


def test_the_plugin_wraps_sglangs_kv_pool_construction(sglang_process):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert (HookType.AROUND, host_pools.build_pool_in_shared_memory) in [
        (kind, hook) for kind, hook, _ in HookRegistry._hooks[host_pools.HOOK_TARGET]]
    assert host_pools.HOOK_TARGET in HookRegistry._patched
    wrapped = pkgutil.resolve_name(host_pools.HOOK_TARGET)
    assert hasattr(wrapped, "__wrapped__")  # SGLang's method, now the hook's wrapper


def _pools():
    return {
        "mha": lambda: ranks.mha_pool(21, start_layer=0, end_layer=3),
        "mla": lambda: ranks.mla_pool(22, layers=3),
        "minimax": lambda: ranks.minimax_pool(23),  # an MHA main pool and the K-only index-K pool
    }


@pytest.mark.parametrize("kind", sorted(_pools()))
def test_every_pointer_of_a_pool_built_through_the_hook_is_in_a_segment(sglang_process, kind):
    pool = _pools()[kind]()
    rank = ranks.rank_kv_args(pool, num_hidden_layers=7 if kind == "minimax" else 3)
    kv_args = rank.kv_args
    exporter = MemoryExporter(cuda=False)
    regions = list(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens))
    for ptrs, lens in zip(kv_args.state_data_ptrs or (), kv_args.state_data_lens or ()):
        regions += list(zip(ptrs, lens))
    assert len(regions) == len(ranks.pool_buffers(pool))  # MiniMax: its main pool holds the dense layers too
    by_address = {b.data_ptr(): b for b in ranks.pool_buffers(pool)}
    for i, (address, length) in enumerate(regions):
        ref = exporter.ref(int(address), int(length), f"region {i}")
        assert isinstance(ref, SharedMemoryRef) and ref.name.startswith("torch_")
        if int(address) in by_address:  # what a broker maps is the pool's own bytes
            buffer = by_address[int(address)]
            assert _segment_bytes(ref, buffer.nbytes) == buffer.view(torch.uint8).numpy().tobytes()


def test_the_pools_pointer_caches_follow_the_move(sglang_process):
    """SGLang caches buffer addresses right after allocating them (the kernels' data_ptrs): they
    must name the shared bytes, not the heap memory the buffers were first given."""
    mha = ranks.mha_pool(24, start_layer=0, end_layer=3)
    assert mha.k_data_ptrs.tolist() == [b.data_ptr() for b in mha.k_buffer]
    assert mha.v_data_ptrs.tolist() == [b.data_ptr() for b in mha.v_buffer]
    mla = ranks.mla_pool(25, layers=3)
    assert mla.data_ptrs.tolist() == [b.data_ptr() for b in mla.kv_buffer]
    minimax = ranks.minimax_pool(26)
    assert minimax.main_pool.k_data_ptrs.tolist() == [b.data_ptr() for b in minimax.main_pool.k_buffer]
    host = MemoryExporter(cuda=False)
    for address in [*mha.data_ptrs.tolist(), *mla.data_ptrs.tolist(), *minimax.main_pool.data_ptrs.tolist()]:
        assert isinstance(host.ref(int(address), 1), SharedMemoryRef)


def test_writes_through_sglangs_own_pool_api_land_in_the_segment(sglang_process):
    pool = ranks.mha_pool(27, start_layer=0, end_layer=3)
    (address,), (length,) = pool.get_contiguous_buf_infos()[0][:1], pool.get_contiguous_buf_infos()[1][:1]
    ref = MemoryExporter(cuda=False).ref(address, length)
    k = torch.full((2, 2, 16), 3.0, dtype=torch.bfloat16)
    pool.set_kv_buffer(None, torch.tensor([5, 6]), k, k, layer_id_override=0)
    row = pool.k_buffer[0][5].view(torch.uint8).numpy().tobytes()
    offset = 5 * pool.k_buffer[0].stride(0) * pool.k_buffer[0].element_size()
    assert _segment_bytes(SharedMemoryRef(ref.name, ref.offset + offset), len(row)) == row
    assert row == k[0].view(torch.uint8).numpy().tobytes()


def test_a_server_on_another_backend_keeps_its_pools_on_the_heap(sglang_process):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
                                            host="127.0.0.1"):
        assert not host_pools.serves_this_process()
        pool = host_pools.build_pool_in_shared_memory(MHATokenToKVPool, 32, 4, torch.bfloat16, 2, 16, 1, "cpu", False,
                                                      start_layer=0, end_layer=1)
    assert host_pools.serves_this_process()
    with pytest.raises(NotExportable, match="private host memory"):
        MemoryExporter(cuda=False).ref(pool.k_buffer[0].data_ptr(), pool.k_buffer[0].nbytes)


def test_only_fresh_cpu_tensors_move_and_views_follow():
    mode = host_pools.SharedHostAllocations()
    owner = np.arange(64, dtype=np.uint8)
    with mode:
        fresh = torch.zeros(4096, dtype=torch.uint8)
        view = fresh[100:]
        wrapped = torch.from_numpy(owner)  # someone else's memory: left where it is
        listed = torch.tensor([1, 2, 3])
    exporter = MemoryExporter(cuda=False)
    assert isinstance(exporter.ref(view.data_ptr(), view.nbytes), SharedMemoryRef)
    assert wrapped.data_ptr() == owner.__array_interface__["data"][0]
    with pytest.raises(NotExportable):
        exporter.ref(listed.data_ptr(), listed.nbytes)
    assert (mode.moved_tensors, mode.moved_bytes) == (1, 4096)
