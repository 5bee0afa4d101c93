"""Pointers to references: host pools by their /dev/shm mapping (this process's real /proc/self/maps),
GPU pools by CUDA IPC of their allocation (a stand-in driver: no GPU here), and what is refused."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

from kvbroker_client import CudaIpcRef, SharedMemoryRef
from kvbroker_client.adapter.memory import (
    DeviceAllocation,
    HostMappings,
    Mapping,
    MemoryExporter,
    NotExportable,
    parse_maps,
)
from kvbroker_client.shm import SharedSegment


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _file_bytes(ref: SharedMemoryRef, n: int) -> bytes:
    with open(f"/dev/shm/{ref.name}", "rb") as f:
        f.seek(ref.offset)
        return f.read(n)


@pytest.fixture
def segment():
    seg = SharedSegment.create(1 << 16, "kvbst")
    seg.array[:] = np.random.default_rng(1).integers(0, 256, seg.size, dtype=np.uint8)
    yield seg
    seg.close()
    seg.unlink()


def test_an_address_in_a_shm_segment_is_its_name_and_offset(segment):
    exporter = MemoryExporter(cuda=False)
    ref = exporter.ref(_address(segment.array) + 4096 + 17, 1000)
    assert ref == SharedMemoryRef(segment.name, 4096 + 17)
    assert _file_bytes(ref, 1000) == segment.array[4096 + 17:4096 + 17 + 1000].tobytes()


def test_a_torch_tensor_shared_under_file_system_resolves_to_torchs_own_segment():
    torch.multiprocessing.set_sharing_strategy("file_system")
    tensor = torch.arange(4096, dtype=torch.int32)
    tensor.untyped_storage().share_memory_()
    view = tensor[1000:]
    ref = MemoryExporter(cuda=False).ref(view.data_ptr(), view.nbytes)
    assert isinstance(ref, SharedMemoryRef) and ref.name.startswith("torch_")
    assert _file_bytes(ref, view.nbytes) == view.numpy().tobytes()


def test_private_host_memory_is_refused_with_what_to_change():
    tensor = torch.zeros(1 << 20, dtype=torch.uint8)  # malloc'd: anonymous, private
    with pytest.raises(NotExportable, match="private host memory.*SharedHostAllocations") as raised:
        MemoryExporter(cuda=False).ref(tensor.data_ptr(), tensor.nbytes, "kv_data_ptrs[3]")
    assert "kv_data_ptrs[3]" in str(raised.value)


def test_an_unlinked_segment_is_refused(segment):
    os.unlink(f"/dev/shm/{segment.name}")
    with pytest.raises(NotExportable, match="unlinked"):
        MemoryExporter(cuda=False).ref(_address(segment.array), 64)


def test_a_region_past_its_mapping_is_refused(segment):
    with pytest.raises(NotExportable, match="runs past the end"):
        MemoryExporter(cuda=False).ref(_address(segment.array) + segment.size - 8, 16)


def test_adjacent_mappings_of_one_file_merge_and_private_file_mappings_are_refused():
    text = ("7f0000000000-7f0000001000 rw-s 00000000 00:1a 5 /dev/shm/pool\n"
            "7f0000001000-7f0000003000 rw-s 00001000 00:1a 5 /dev/shm/pool\n"
            "7f0000003000-7f0000004000 rw-p 00000000 00:1a 6 /dev/shm/cow\n"
            "7f0000005000-7f0000006000 rw-s 00000000 00:1a 7 /var/lib/file\n"
            "7f0000007000-7f0000008000 rw-p 00000000 00:00 0\n")
    mappings = parse_maps(text)
    assert mappings[0] == Mapping(0x7F0000000000, 0x7F0000001000, 0, "/dev/shm/pool", True)
    host = HostMappings(mappings, text)
    assert host.ref(0x7F0000000800, 0x2000) == SharedMemoryRef("pool", 0x800)
    with pytest.raises(NotExportable, match="private"):
        host.ref(0x7F0000003000, 16)
    with pytest.raises(NotExportable, match="not a /dev/shm segment"):
        host.ref(0x7F0000005000, 16)
    assert host.ref(0x7F0000007000, 16) is None  # anonymous: not a file; the exporter asks CUDA next


class StandInDriver:
    """Plays libcuda for export: allocations by address range, handles by allocation."""

    def __init__(self, *allocations: DeviceAllocation) -> None:
        self.allocations = allocations
        self.handle_calls = 0

    def allocation(self, address: int) -> DeviceAllocation | None:
        return next((a for a in self.allocations if a.base <= address < a.base + a.size), None)

    def ipc_handle(self, allocation: DeviceAllocation) -> bytes:
        self.handle_calls += 1
        return allocation.base.to_bytes(8, "little") * 8


def _private_host() -> HostMappings:
    return HostMappings([], "")


def test_a_gpu_address_is_its_allocations_ipc_handle_and_offset():
    alloc = DeviceAllocation(base=0x7F00_0000_0000, size=1 << 30, device=3, ipc_capable=True)
    driver = StandInDriver(alloc)
    exporter = MemoryExporter(host=_private_host(), cuda=driver)
    first = exporter.ref(alloc.base + 4096, 1 << 20)
    second = exporter.ref(alloc.base + (1 << 21), 1 << 20)
    assert first == CudaIpcRef(alloc.base.to_bytes(8, "little") * 8, 3, 4096, 1 << 30)
    assert second.offset == 1 << 21 and second.handle == first.handle
    assert driver.handle_calls == 1  # one handle per allocation, as the broker opens each once


def test_expandable_segments_are_refused_saying_how_to_turn_them_off():
    alloc = DeviceAllocation(base=0x7F00_0000_0000, size=1 << 30, device=0, ipc_capable=False)
    with pytest.raises(NotExportable, match="expandable_segments:False"):
        MemoryExporter(host=_private_host(), cuda=StandInDriver(alloc)).ref(alloc.base, 4096)


def test_a_region_past_its_cuda_allocation_is_refused():
    alloc = DeviceAllocation(base=0x7F00_0000_0000, size=1 << 20, device=0, ipc_capable=True)
    with pytest.raises(NotExportable, match="past the end of its CUDA allocation"):
        MemoryExporter(host=_private_host(), cuda=StandInDriver(alloc)).ref(alloc.base + 4096, 1 << 20)


def test_without_a_driver_unknown_memory_is_private_host_memory():
    buffer = ctypes.create_string_buffer(64)
    with pytest.raises(NotExportable, match="no CUDA driver"):
        MemoryExporter(cuda=False).ref(ctypes.addressof(buffer), 64)
