"""GPU memory without a GPU: CUDA IPC references validated, serialised and resolved against a stand-in driver.

The stand-in (`FakeDriver`) plays libcuda for memory.GpuMemory: it hands out addresses for handles
it knows, counts opens and closes, and allocates broker-owned pools. What only a real GPU can show
(the driver opening another process's memory, RDMA registration of it, bytes moving) is at the end,
skipped without CUDA, and in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvbroker.backends import backend_options
from kvbroker.backends.mooncake import MooncakeBackend
from kvbroker.backends.nixl import NixlBackend
from kvbroker.config import Settings
from kvbroker.core.errors import Code
from kvbroker.core.model import (
    BrokerAllocation,
    BufferLayout,
    BufferRole,
    Component,
    ComponentSpec,
    CudaIpcRef,
    Descriptors,
    EngineSpec,
    KvDtype,
    LayerBuffer,
    Layout,
    MemoryKind,
    Region,
    SharedMemoryRef,
    Topology,
)
from kvbroker.core.planner import build_descriptors, plan_runs
from kvbroker.core.validation import validate_spec
from kvbroker.edge import convert
from kvbroker.flows.registry import Registry
from kvbroker.memory.cuda import CudaError, CudaUnavailable, OpenedAllocation
from kvbroker.memory.mapping import POOL_ALIGNMENT, GpuMemory, plan_pool
from kvbroker_client.model import CudaIpcRef as ClientCudaIpcRef
from kvbroker_client.tensors import cuda_ipc_ref_from_reduction, ipc_mem_handle
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from tests.support.helpers import refusal

TOPO = Topology(1, 0, 1, 0, 1, 0, 0, 16, 0, 4, KvDtype.BFLOAT16)
HANDLE_A = bytes(range(1, 65))
HANDLE_B = bytes(range(101, 165))
GiB = 1 << 30


class FakeDriver:
    """libcuda as GpuMemory sees it: two exported allocations (A on device 0, B on device 1)."""

    def __init__(self, device_count: int = 2) -> None:
        self.device_count = device_count
        self.exported = {HANDLE_A: OpenedAllocation(0x7F00_0000_0000, 1 << 20, 0),
                         HANDLE_B: OpenedAllocation(0x7E00_0000_0000, 1 << 20, 1)}
        self.opens: list[tuple[bytes, int]] = []
        self.closed: list[int] = []
        self.pools: dict[int, int] = {}  # address -> size, while allocated
        self.out_of_memory = False

    def open_ipc(self, handle: bytes, device: int) -> OpenedAllocation:
        if handle not in self.exported:
            raise CudaError("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
        self.opens.append((handle, device))
        return self.exported[handle]

    def close_ipc(self, address: int, device: int) -> None:
        self.closed.append(address)

    def allocate(self, device: int, size: int) -> tuple[int, bytes]:
        if self.out_of_memory:
            raise CudaError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        address = 0x7D00_0000_0000 + len(self.pools) * (1 << 34)
        self.pools[address] = size
        return address, bytes([0xEE] * 63 + [len(self.pools)])

    def free(self, address: int, device: int) -> None:
        del self.pools[address]

    @property
    def open_now(self) -> int:
        return len(self.opens) - len(self.closed)


def no_cuda() -> FakeDriver:
    raise CudaUnavailable("libcuda.so.1 cannot be loaded (no NVIDIA driver in this container)")


@pytest.fixture
def driver() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def registry(driver) -> Registry:
    return Registry(1 << 20, gpu=GpuMemory(lambda: driver))


def cuda_buf(layer, role=BufferRole.FLAT, handle=HANDLE_A, device=0, offset=0, length=1024, item_len=64,
             allocation_size=1 << 20):
    return LayerBuffer(layer, role, CudaIpcRef(handle, device, offset, allocation_size), length, item_len)


def pooled_buf(layer, role=BufferRole.FLAT, length=1000, item_len=50):
    return LayerBuffer(layer, role, None, length, item_len)


def index_k(*buffers, num_pages=16):
    return ComponentSpec(Component.MINIMAX_INDEX_K, Layout.FLAT, num_pages, tuple(buffers))


def spec(*components, engine_id="prefill-0/tp0", allocation=None):
    return EngineSpec(engine_id, TOPO, tuple(components), allocation)



# -- validation, without touching a GPU ------------------------------------------------------------
AT = "components[0].layer_buffers[0] (layer 2, FLAT).memory.cuda_ipc"


@pytest.mark.parametrize("bad, words", [
    (cuda_buf(2, handle=b"\x01" * 63), f"{AT}.handle: must be the 64-byte cudaIpcMemHandle_t, got 63 bytes"),
    (cuda_buf(2, handle=b"\x03c" + HANDLE_A), "got 66 bytes; this looks like torch's storage handle"),
    (cuda_buf(2, handle=bytes(64)), f"{AT}.handle: all 64 bytes are zero"),
    (cuda_buf(2, device=256), f"{AT}.device: 256 is not a plausible CUDA device ordinal"),
    (cuda_buf(2, allocation_size=0), f"{AT}.allocation_size: must be greater than zero"),
    (cuda_buf(2, offset=4096, allocation_size=5000), f"{AT}: offset 4096 + length 1024 exceeds allocation_size 5000"),
])
def test_bad_cuda_refs_are_invalid_argument_naming_the_field(bad, words):
    error = refusal(validate_spec, spec(index_k(bad)), 1 << 20)
    assert error.code is Code.INVALID_ARGUMENT
    assert words in error.reason


def test_an_engine_cannot_mix_host_and_gpu_memory():
    error = refusal(validate_spec, spec(index_k(cuda_buf(2), LayerBuffer(3, BufferRole.FLAT, SharedMemoryRef("s", 0),
                                                                           1024, 64))), 1 << 20)
    assert error.code is Code.INVALID_ARGUMENT
    assert "layer_buffers[1] (layer 3, FLAT).memory: shared_memory, but components[0].layer_buffers[0] " \
           "(layer 2, FLAT) is cuda_ipc" in error.reason


def test_broker_owned_buffers_must_not_name_memory():
    error = refusal(validate_spec, spec(index_k(cuda_buf(2)), allocation=BrokerAllocation(0)), 1 << 20)
    assert "(layer 2, FLAT).memory: must be unset with MEMORY_OWNERSHIP_BROKER" in error.reason


def test_broker_owned_pool_device_must_be_plausible():
    error = refusal(validate_spec, spec(index_k(pooled_buf(2)), allocation=BrokerAllocation(1000)), 1 << 20)
    assert error.code is Code.INVALID_ARGUMENT and error.reason.startswith("allocation_device: 1000")


def test_pool_plan_aligns_every_buffer_and_the_end():
    offsets, size = plan_pool([1000, 4096, 1, 8192])
    assert offsets == [0, 4096, 8192, 12288]
    assert size == 20480 and all(o % POOL_ALIGNMENT == 0 for o in offsets)
    assert plan_pool([]) == ([], 0)


# -- without CUDA --------------------------------------------------------------------------------
def test_cuda_ref_on_a_broker_without_cuda_is_refused_naming_the_field():
    error = refusal(Registry(1 << 20, gpu=GpuMemory(no_cuda)).build, spec(index_k(cuda_buf(2))))
    assert error.code is Code.INVALID_ARGUMENT
    assert f"{AT}: this broker has no CUDA support; use shared_memory (libcuda.so.1 cannot be loaded" \
        in error.reason


def test_broker_owned_pool_on_a_broker_without_cuda_is_refused():
    error = refusal(Registry(1 << 20, gpu=GpuMemory(no_cuda)).build,
                    spec(index_k(pooled_buf(2)), allocation=BrokerAllocation(0)))
    assert error.code is Code.INVALID_ARGUMENT
    assert error.reason.startswith("memory_ownership: MEMORY_OWNERSHIP_BROKER: this broker has no CUDA support")


def test_the_driver_is_loaded_once_even_when_it_is_missing():
    calls = []

    def load():
        calls.append(1)
        return no_cuda()

    gpu = GpuMemory(load)
    for _ in range(3):
        refusal(gpu.driver, "x")
    assert len(calls) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a broker on a machine without CUDA")
def test_this_machine_has_no_cuda_and_says_why():
    error = refusal(Registry(1 << 20).build, spec(index_k(cuda_buf(2))))
    assert "this broker has no CUDA support; use shared_memory (" in error.reason


class _Symbol:
    """One libcuda entry point of `_Lib`: records its calls, succeeds."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, *args) -> int:
        self.calls.append(self.name)
        return 0


class _Lib:
    """A libcuda with every plain and `_v2` symbol the driver might bind."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> _Symbol:
        if not name.startswith("cu"):
            raise AttributeError(name)
        symbol = _Symbol(name, self.calls)
        setattr(self, name, symbol)
        return symbol


def test_the_driver_calls_the_context_synchronize_that_takes_no_context():
    # CUDA 13's cuCtxSynchronize_v2 takes a CUcontext; called with none it read garbage, and the
    # first broker-owned pool on an H200 failed with CUDA_ERROR_CONTEXT_IS_DESTROYED.
    from kvbroker.memory.cuda import CudaDriver

    lib = _Lib()
    CudaDriver(lib).allocate(0, 4096)
    assert "cuCtxSynchronize" in lib.calls and "cuCtxSynchronize_v2" not in lib.calls
    assert {"cuMemAlloc_v2", "cuMemsetD8_v2", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"} <= set(lib.calls)


def test_nixl_builds_its_agent_with_ucx_asking_the_driver_for_memory_types(monkeypatch):
    # Imported (server-owned) GPU memory misses UCX's memtype cache and would register as host memory.
    import kvbroker.backends.nixl as nixl_backend

    monkeypatch.delenv("UCX_MEMTYPE_CACHE", raising=False)
    seen = []
    monkeypatch.setattr(nixl_backend, "new_agent", lambda *args: seen.append(os.environ.get("UCX_MEMTYPE_CACHE")))
    backend = NixlBackend(backend_options(Settings(), "unit"))

    async def run():
        await backend.start()
        backend._executor.shutdown(wait=True)

    asyncio.run(run())
    assert seen == ["n"] and "UCX_MEMTYPE_CACHE" not in os.environ


# -- imported allocations ------------------------------------------------------------------------
def test_gpu_buffers_resolve_inside_the_opened_allocation(registry, driver):
    engine = registry.build(spec(index_k(cuda_buf(2, offset=4096), cuda_buf(3, offset=8192))))
    base = driver.exported[HANDLE_A].address
    buffers = engine.layout.components[Component.MINIMAX_INDEX_K].buffers
    assert [(b.address, b.device, b.memory_kind) for b in buffers] == [
        (base + 4096, 0, MemoryKind.GPU), (base + 8192, 0, MemoryKind.GPU)]
    assert engine.regions == [Region(base + 4096, 1024, 0, gpu=True), Region(base + 8192, 1024, 0, gpu=True)]
    engine.release()


def test_one_allocation_is_opened_once_and_closed_with_its_last_engine(registry, driver):
    first = registry.build(spec(index_k(cuda_buf(2), cuda_buf(3, offset=1024)), engine_id="a"))
    registry.add(first)
    second = registry.build(spec(index_k(cuda_buf(2, offset=2048)), engine_id="b"))
    registry.add(second)
    assert driver.opens == [(HANDLE_A, 0)]
    registry.remove("a")
    first.release()
    assert driver.closed == []  # engine b still uses it
    registry.remove("b")
    second.release()
    assert driver.closed == [driver.exported[HANDLE_A].address]
    assert registry._gpu.imports == []


def test_allocations_on_two_devices_are_both_opened(registry, driver):
    engine = registry.build(spec(index_k(cuda_buf(2), cuda_buf(3, handle=HANDLE_B, device=1))))
    assert sorted(driver.opens) == [(HANDLE_A, 0), (HANDLE_B, 1)]
    engine.release()
    assert driver.open_now == 0


def test_an_allocation_the_driver_will_not_close_does_not_keep_the_others_open(registry, driver, caplog):
    engine = registry.build(spec(index_k(cuda_buf(2), cuda_buf(3, handle=HANDLE_B, device=1))))
    refused = driver.exported[HANDLE_A].address

    def close_ipc(address: int, device: int) -> None:
        if address == refused:  # e.g. the exporting server died and the driver already dropped it
            raise CudaError("cuIpcCloseMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
        driver.closed.append(address)

    driver.close_ipc = close_ipc
    engine.release()
    assert driver.closed == [driver.exported[HANDLE_B].address]
    assert registry._gpu.imports == []  # the refused one is forgotten too: nothing would close it later
    assert "cuIpcCloseMemHandle failed: CUDA_ERROR_INVALID_VALUE" in caplog.text


def test_overlapping_regions_of_one_allocation_are_refused_across_engines(registry):
    registry.add(registry.build(spec(index_k(cuda_buf(2)), engine_id="a")))
    error = refusal(registry.build, spec(index_k(cuda_buf(2, offset=512)), engine_id="b"))
    assert error.code is Code.INVALID_ARGUMENT
    assert "overlaps components[0].layer_buffers[0] (layer 2, FLAT) of engine 'a' in CUDA allocation 0102030405060708"\
        in error.reason


def test_same_offsets_in_different_allocations_do_not_overlap(registry, driver):
    engine = registry.build(spec(index_k(cuda_buf(2), cuda_buf(3, handle=HANDLE_B, device=1))))
    engine.release()


def test_an_allocation_smaller_than_declared_is_refused_and_closed(registry, driver):
    error = refusal(registry.build, spec(index_k(cuda_buf(2, allocation_size=2 << 20))))
    assert error.code is Code.INVALID_ARGUMENT
    assert f"{AT}.allocation_size: 2097152 bytes declared, but the allocation of this handle has 1048576" \
        in error.reason
    assert driver.open_now == 0 and registry._gpu.imports == []


def test_a_device_the_broker_numbers_differently_is_refused(registry, driver):
    error = refusal(registry.build, spec(index_k(cuda_buf(2, handle=HANDLE_B, device=0))))
    assert f"{AT}.device: declared 0, but the allocation is on device 1" in error.reason
    assert driver.open_now == 0


def test_a_device_the_broker_does_not_have_is_refused(driver):
    registry = Registry(1 << 20, gpu=GpuMemory(lambda: FakeDriver(device_count=1)))
    error = refusal(registry.build, spec(index_k(cuda_buf(2, handle=HANDLE_B, device=1))))
    assert f"{AT}.device: 1 is not a CUDA device of this broker, which sees 1" in error.reason


def test_a_handle_the_driver_cannot_open_is_refused_with_its_word(registry):
    error = refusal(registry.build, spec(index_k(cuda_buf(2, handle=b"\x09" * 64))))
    assert error.code is Code.INVALID_ARGUMENT
    assert f"{AT}.handle: the CUDA driver cannot open it (CUDA_ERROR_INVALID_VALUE)" in error.reason


def test_a_refusal_after_opening_closes_what_was_opened(registry, driver):
    error = refusal(registry.build, spec(index_k(cuda_buf(2), cuda_buf(3, handle=b"\x09" * 64))))
    assert "layer_buffers[1]" in error.reason
    assert driver.open_now == 0 and registry._gpu.imports == []


# -- broker-owned pools --------------------------------------------------------------------------
def test_broker_owned_pool_places_every_buffer_and_returns_its_handle(registry, driver):
    main = ComponentSpec(Component.MAIN_KV, Layout.KV_SPLIT, 16,
                         (pooled_buf(2, BufferRole.K, 1600, 100), pooled_buf(2, BufferRole.V, 1600, 100)))
    engine = registry.build(spec(main, index_k(pooled_buf(2, length=800, item_len=50)),
                                 allocation=BrokerAllocation(1)))
    (address, size), = driver.pools.items()
    assert size == 3 * 4096
    refs = [b.memory for c in engine.spec.components for b in c.layer_buffers]
    assert {(r.handle, r.device, r.allocation_size) for r in refs} == {(bytes([0xEE] * 63 + [1]), 1, 3 * 4096)}
    assert [r.offset for r in refs] == [0, 4096, 8192]
    kv = engine.layout.components[Component.MAIN_KV].buffers
    assert [(b.address, b.device, b.memory_kind) for b in kv] == [
        (address, 1, MemoryKind.GPU), (address + 4096, 1, MemoryKind.GPU)]
    assert all(r.gpu and r.device == 1 for r in engine.regions)
    assert driver.opens == []  # the broker never opens its own handle
    engine.release()
    assert driver.pools == {}


def test_the_registration_reply_of_a_broker_owned_engine_carries_the_pool_handle(registry, driver):
    engine = registry.build(spec(index_k(pooled_buf(2), pooled_buf(3)), allocation=BrokerAllocation(0)))
    wire = [convert.component_spec_out(c) for c in engine.spec.components]
    refs = [b.memory.cuda_ipc for b in wire[0].layer_buffers]
    assert [(r.handle, r.device, r.offset, r.allocation_size) for r in refs] == [
        (bytes([0xEE] * 63 + [1]), 0, 0, 8192), (bytes([0xEE] * 63 + [1]), 0, 4096, 8192)]
    engine.release()


def test_broker_owned_pool_out_of_memory_is_resource_exhausted(registry, driver):
    driver.out_of_memory = True
    error = refusal(registry.build, spec(index_k(pooled_buf(2)), allocation=BrokerAllocation(0)))
    assert error.code is Code.RESOURCE_EXHAUSTED and "CUDA_ERROR_OUT_OF_MEMORY" in error.reason


def test_broker_owned_pool_on_a_device_the_broker_lacks_is_refused(registry, driver):
    error = refusal(registry.build, spec(index_k(pooled_buf(2)), allocation=BrokerAllocation(5)))
    assert error.code is Code.INVALID_ARGUMENT
    assert "MEMORY_OWNERSHIP_BROKER: 5 is not a CUDA device of this broker, which sees 2" in error.reason
    assert driver.pools == {}


# -- serialisation ---------------------------------------------------------------------------------
def register_request(**fields) -> bpb.RegisterEngineRequest:
    buffer = pb.LayerBuffer(layer_id=2, role=pb.BUFFER_ROLE_FLAT, length=1024, item_len=64)
    if "memory" in fields:
        buffer.memory.CopyFrom(fields.pop("memory"))
    return bpb.RegisterEngineRequest(
        engine_id="e", topology=convert.topology_out(TOPO),
        components=[pb.ComponentSpec(component=pb.COMPONENT_MINIMAX_INDEX_K, layout=pb.LAYOUT_FLAT, num_pages=16,
                                     layer_buffers=[buffer])], **fields)


def test_a_client_cuda_ref_reaches_the_broker_unchanged():
    sent = ClientCudaIpcRef(HANDLE_A, 3, 4096, 1 << 20)
    wire = register_request(memory=sent.to_proto()).SerializeToString()
    spec_in = convert.engine_spec_in(bpb.RegisterEngineRequest.FromString(wire))
    assert spec_in.components[0].layer_buffers[0].memory == CudaIpcRef(HANDLE_A, 3, 4096, 1 << 20)
    assert spec_in.broker_allocation is None
    out = convert.component_spec_out(spec_in.components[0]).layer_buffers[0].memory.cuda_ipc
    assert (out.handle, out.device, out.offset, out.allocation_size) == (HANDLE_A, 3, 4096, 1 << 20)


@pytest.mark.parametrize("ownership, expected", [
    (bpb.MEMORY_OWNERSHIP_UNSPECIFIED, None),
    (bpb.MEMORY_OWNERSHIP_SERVER, None),
    (bpb.MEMORY_OWNERSHIP_BROKER, BrokerAllocation(2)),
])
def test_memory_ownership_is_read_with_unspecified_as_server(ownership, expected):
    device = 2 if ownership == bpb.MEMORY_OWNERSHIP_BROKER else 0
    request = register_request(memory_ownership=ownership, allocation_device=device)
    assert convert.engine_spec_in(request).broker_allocation == expected


def test_allocation_device_without_broker_ownership_is_refused():
    error = refusal(convert.engine_spec_in, register_request(allocation_device=1))
    assert error.reason.startswith("allocation_device: 1 is set, but only MEMORY_OWNERSHIP_BROKER allocates")


def test_unknown_memory_ownership_is_refused():
    error = refusal(convert.engine_spec_in, register_request(memory_ownership=9))
    assert error.code is Code.INVALID_ARGUMENT and error.reason.startswith("memory_ownership: ")


def test_engine_info_says_who_owns_the_memory():
    assert convert.memory_ownership_out(spec(index_k(pooled_buf(2)), allocation=BrokerAllocation(0))) \
        == bpb.MEMORY_OWNERSHIP_BROKER
    assert convert.memory_ownership_out(spec(index_k(cuda_buf(2)))) == bpb.MEMORY_OWNERSHIP_SERVER


def test_the_handshake_carries_the_memory_kind_of_each_buffer(registry):
    engine = registry.build(spec(index_k(cuda_buf(2))))
    wire = convert.engine_layout_out(engine.layout).SerializeToString()
    peer = convert.engine_layout_in(ppb.PeerEngine.FromString(wire))
    assert peer.components[Component.MINIMAX_INDEX_K].buffers == \
        engine.layout.components[Component.MINIMAX_INDEX_K].buffers
    engine.release()


def peer_engine(*kinds: int) -> ppb.PeerEngine:
    return ppb.PeerEngine(engine_id="p", topology=convert.topology_out(TOPO), components=[ppb.PeerComponent(
        component=pb.COMPONENT_MINIMAX_INDEX_K, layout=pb.LAYOUT_FLAT, num_pages=16,
        layer_buffers=[ppb.PeerLayerBuffer(layer_id=i, role=pb.BUFFER_ROLE_FLAT, address=4096 * i, length=1024,
                                           item_len=64, memory_kind=k) for i, k in enumerate(kinds)])])


def test_a_peer_that_does_not_say_the_memory_kind_is_host_memory():
    peer = convert.engine_layout_in(peer_engine(pb.MEMORY_KIND_UNSPECIFIED))
    assert peer.components[Component.MINIMAX_INDEX_K].buffers[0].memory_kind is MemoryKind.HOST


def test_a_peer_engine_mixing_memory_kinds_is_refused():
    error = refusal(convert.engine_layout_in, peer_engine(pb.MEMORY_KIND_HOST, pb.MEMORY_KIND_GPU))
    assert "mix host and GPU memory" in error.reason


# -- descriptors and the engines' memory kinds ---------------------------------------------------
def layouts(kind: MemoryKind, base: int, device: int = 0):
    return [BufferLayout(0, BufferRole.K, base, 6400, 64, device, kind),
            BufferLayout(0, BufferRole.V, base + 8192, 6400, 64, device, kind)]


def test_descriptors_carry_each_sides_memory_kind():
    runs = plan_runs(np.arange(4), np.arange(10, 14))
    d = build_descriptors(runs, layouts(MemoryKind.GPU, 1 << 40, device=1), layouts(MemoryKind.HOST, 1 << 20))
    assert (d.src_memory_kind, d.dst_memory_kind) == (MemoryKind.GPU, MemoryKind.HOST)
    assert d.src[:, 2].tolist() == [1, 1] and d.dst[:, 2].tolist() == [0, 0]


def test_descriptors_refuse_a_side_that_mixes_memory_kinds():
    mixed = [layouts(MemoryKind.GPU, 0)[0], layouts(MemoryKind.HOST, 0)[1]]
    with pytest.raises(ValueError, match="source layer buffers mix host and GPU memory"):
        build_descriptors(plan_runs(np.arange(2), np.arange(2)), mixed, layouts(MemoryKind.HOST, 0))


class FakeNixlAgent:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register_memory(self, descs, kind):
        self.calls.append(("register", kind, [d[2] for d in descs]))
        return kind

    def get_xfer_descs(self, rows, kind):
        self.calls.append(("descs", kind, rows[:, 2].tolist()))
        return kind

    def initialize_xfer(self, op, local, remote, peer):
        return (local, remote)

    def transfer(self, handle):
        return "DONE"

    def release_xfer_handle(self, handle):
        pass


def test_nixl_registers_and_writes_gpu_memory_as_vram():
    backend = NixlBackend(backend_options(Settings(), "unit"))
    backend._agent = agent = FakeNixlAgent()

    async def run():
        await backend.register([Region(1 << 40, 4096, 1, gpu=True)])
        await backend.register([Region(1 << 20, 4096, 0, gpu=False)])
        rows = np.array([[1 << 40, 64, 1]], dtype=np.uint64)
        await backend.write("peer", Descriptors(rows, rows.copy(), MemoryKind.GPU, MemoryKind.HOST), 5.0)
        backend._executor.shutdown(wait=True)

    asyncio.run(run())
    assert agent.calls == [("register", "VRAM", [1]), ("register", "DRAM", [0]),
                           ("descs", "VRAM", [1]), ("descs", "DRAM", [1])]


def test_mooncake_names_gpu_memory_by_its_device():
    backend = MooncakeBackend(backend_options(Settings(), "unit"))
    locations = []

    class Engine:
        def register_memory(self, address, length, location):
            locations.append(location)
            return 0

    backend._engine = Engine()

    async def run():
        await backend.register([Region(1 << 40, 4096, 3, gpu=True), Region(1 << 20, 4096, 0, gpu=False)])
        backend._control.shutdown(wait=True)
        backend._writers.shutdown(wait=True)

    asyncio.run(run())
    assert locations == ["cuda:3", "*"]


# -- the client's side: torch's handle to a CudaIpcRef -------------------------------------------
@pytest.mark.parametrize("version", [2, 3])
def test_torch_storage_handles_of_cuda_malloc_blocks_yield_the_ipc_handle(version):
    assert ipc_mem_handle(bytes([version]) + b"c" + HANDLE_A) == HANDLE_A


def test_a_bare_64_byte_handle_is_taken_as_is():
    assert ipc_mem_handle(HANDLE_A) == HANDLE_A


def test_expandable_segments_are_refused_with_the_setting_to_change():
    with pytest.raises(ValueError, match="expandable_segments:False"):
        ipc_mem_handle(b"\x03e" + bytes(100))


def test_an_unknown_storage_handle_is_refused():
    with pytest.raises(ValueError, match="unrecognised torch CUDA storage handle of 10 bytes"):
        ipc_mem_handle(bytes(10))


def test_a_reduced_tensor_becomes_a_ref_at_its_offset_in_the_block():
    # rebuild_cuda_tensor's arguments: cls, size, stride, offset, storage cls, dtype, device, handle,
    # storage size (bytes), storage offset in the block (bytes), requires_grad, ref counter..., event...
    args = (torch.Tensor, (4, 8), (8, 1), 16, None, torch.bfloat16, 1, b"\x03c" + HANDLE_A, 1 << 16, 1 << 20,
            False, b"rc", 0, b"ev", True)
    ref = cuda_ipc_ref_from_reduction(args, tensor_offset_bytes=16 * 2)
    assert ref == ClientCudaIpcRef(HANDLE_A, 1, (1 << 20) + 32, (1 << 20) + (1 << 16))


# -- on a GPU ------------------------------------------------------------------------------------
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and a CUDA build of torch")

SERVER = """
import sys, torch
from kvbroker_client.tensors import cuda_ipc_ref
t = torch.full((256, 1024), 7, dtype=torch.uint8, device="cuda")
ref = cuda_ipc_ref(t[16:])
print(ref.handle.hex(), ref.device, ref.offset, ref.allocation_size, flush=True)
sys.stdin.readline()
"""


@CUDA
def test_a_tensor_exported_by_another_process_opens_once_in_the_broker():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle, device, offset, allocation_size = server.stdout.readline().split()
        ref = CudaIpcRef(bytes.fromhex(handle), int(device), int(offset), int(allocation_size))
        gpu = GpuMemory()
        lease = gpu.import_allocation(ref, "memory.cuda_ipc")
        assert lease.size >= ref.allocation_size and ref.offset == 16 * 1024
        again = gpu.import_allocation(ref, "memory.cuda_ipc")
        assert again.address == lease.address and len(gpu.imports) == 1
        again.close()
        lease.close()
        assert gpu.imports == []
    finally:
        server.stdin.write("\n")
        server.stdin.close()
        server.wait(timeout=30)


@CUDA
def test_a_broker_owned_pool_is_allocated_zeroed_and_freed():
    gpu = GpuMemory()
    pool = gpu.allocate_pool(0, 1 << 20, "memory_ownership")
    assert len(pool.handle) == 64 and any(pool.handle) and pool.size == 1 << 20
    pool.close()
