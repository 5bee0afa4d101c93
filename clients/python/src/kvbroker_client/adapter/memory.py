"""Raw pointers into an inference engine's memory as memory references a broker can open.

Engines hand a transfer backend bare addresses (SGLang's `kv_data_ptrs`, a vLLM tensor's data_ptr)
into their pools. A broker is another process, so each address must become something it can map:

    host memory   the /dev/shm file whose shared mapping holds the address, and the offset in that
                  file (read from /proc/self/maps)                        -> SharedMemoryRef
    GPU memory    the CUDA IPC handle of the allocation that holds the address, and the offset in
                  it (cuMemGetAddressRange, cuIpcGetMemHandle)            -> CudaIpcRef

    MemoryExporter(host_hint=...).ref(address, length)   one region; raises NotExportable saying what
                                            to change (the adapter's hint: how its engine's host
                                            pools are placed in shared memory)
    host_mappings(maps_text)                /proc/self/maps parsed: shared file mappings only

What cannot be exported, and why: private host memory (plain malloc/torch CPU tensors, pinned host
buffers) has no name another process can open; CUDA memory from the VMM API (PyTorch's
`expandable_segments:True`) has no legacy IPC handle; an unlinked /dev/shm file has no name left.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbroker_client import CudaIpcRef, MemoryRef, SharedMemoryRef

SHM_DIR = "/dev/shm/"
_DELETED = " (deleted)"


class NotExportable(ValueError):
    """A region no broker can open; the message names the region and what the operator can change."""


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/maps that maps a file shared: [start, end) is file[offset, ...)."""

    start: int
    end: int
    offset: int
    path: str
    shared: bool


def parse_maps(text: str) -> list[Mapping]:
    """Every mapping of /proc/<pid>/maps that names a file (anonymous ones carry no path)."""
    out = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        addresses, perms, offset = fields[0], fields[1], fields[2]
        start, end = (int(x, 16) for x in addresses.split("-"))
        out.append(Mapping(start, end, int(offset, 16), fields[5], perms[3:4] == "s"))
    return out


def describe(address: int, text: str) -> str:
    """What /proc/self/maps says about the mapping holding `address`, for error messages."""
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            what = fields[5] if len(fields) == 6 else "anonymous"
            return f"{fields[1]} mapping [{start:#x}, {end:#x}) of {what}"
    return "no mapping of this process"


class HostMappings:
    """The /dev/shm file mappings of a process, merged where one file continues across lines."""

    def __init__(self, mappings: Iterable[Mapping], maps_text: str = "") -> None:
        merged: list[Mapping] = []
        for m in sorted(mappings, key=lambda m: m.start):
            last = merged[-1] if merged else None
            if (last is not None and last.path == m.path and last.shared == m.shared and last.end == m.start
                    and last.offset + (last.end - last.start) == m.offset):
                merged[-1] = Mapping(last.start, m.end, last.offset, m.path, m.shared)
            else:
                merged.append(m)
        self._mappings = merged
        self._starts = [m.start for m in merged]
        self._text = maps_text

    @classmethod
    def of_this_process(cls) -> HostMappings:
        with open("/proc/self/maps") as f:
            text = f.read()
        return cls(parse_maps(text), text)

    def find(self, address: int) -> Mapping | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._mappings[i].end:
            return self._mappings[i]
        return None

    def ref(self, address: int, length: int) -> SharedMemoryRef | None:
        """The segment and offset of [address, address + length); None when no file maps the address."""
        m = self.find(address)
        if m is None:
            return None
        if not m.shared:
            raise NotExportable(f"host region [{address:#x}, +{length}) is a private (copy-on-write) mapping of "
                                f"{m.path}: a broker mapping the same file would not see its bytes")
        path = m.path.removesuffix(_DELETED)
        if not path.startswith(SHM_DIR) or "/" in path[len(SHM_DIR):]:
            raise NotExportable(f"host region [{address:#x}, +{length}) is in {m.path}, not a /dev/shm segment: "
                                "brokers open host memory by its shared-memory name")
        if m.path.endswith(_DELETED):
            raise NotExportable(f"host region [{address:#x}, +{length}) is in {path}, which was unlinked: no "
                                "process can open it by name any more; keep the segment linked while the "
                                "engine is registered")
        if address + length > m.end:
            raise NotExportable(f"host region [{address:#x}, +{length}) runs past the end of its mapping of {path} "
                                f"([{m.start:#x}, {m.end:#x}))")
        return SharedMemoryRef(path[len(SHM_DIR):], m.offset + address - m.start)

    def explain(self, address: int) -> str:
        return describe(address, self._text) if self._text else "unknown mapping"


# -- GPU memory ----------------------------------------------------------------------------------

IPC_HANDLE_SIZE = 64


@dataclass(frozen=True)
class DeviceAllocation:
    """The CUDA allocation holding a device address, as the driver reports it."""

    base: int
    size: int
    device: int
    ipc_capable: bool  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE


class CudaDriver(Protocol):
    """The few driver answers export needs; `LibCuda` asks libcuda.so.1 for them."""

    def allocation(self, address: int) -> DeviceAllocation | None:
        """The allocation holding `address`; None when it is not device memory."""
        ...

    def ipc_handle(self, allocation: DeviceAllocation) -> bytes:
        """The 64-byte cudaIpcMemHandle_t of an allocation."""
        ...


_CU_MEMORYTYPE_DEVICE = 2
_ATTR_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_ATTR_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class LibCuda:
    """CudaDriver on libcuda.so.1 through ctypes; each call runs in the pointer's primary context."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._check("cuInit", lib.cuInit(0))

    @classmethod
    def load(cls) -> LibCuda | None:
        """The driver, or None where this process has no CUDA (no libcuda, no device)."""
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        try:
            return cls(lib)
        except RuntimeError:
            return None

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(code, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {(name.value or b'CUDA error %d' % code).decode()}")

    def _attribute(self, ctype, attribute: int, address: int) -> int | None:
        value = ctype()
        code = self._lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ctypes.c_uint64(address))
        return None if code != 0 else value.value

    def allocation(self, address: int) -> DeviceAllocation | None:
        if self._attribute(ctypes.c_uint, _ATTR_MEMORY_TYPE, address) != _CU_MEMORYTYPE_DEVICE:
            return None
        device = self._attribute(ctypes.c_int, _ATTR_DEVICE_ORDINAL, address)
        ipc = bool(self._attribute(ctypes.c_int, _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, address))
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self._context(device or 0):
            self._check("cuMemGetAddressRange", self._lib.cuMemGetAddressRange_v2(
                ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)))
        return DeviceAllocation(base.value, size.value, device or 0, ipc)

    def ipc_handle(self, allocation: DeviceAllocation) -> bytes:
        handle = _IpcMemHandle()
        with self._context(allocation.device):
            self._check("cuIpcGetMemHandle", self._lib.cuIpcGetMemHandle(
                ctypes.byref(handle), ctypes.c_uint64(allocation.base)))
        return bytes(handle.reserved)

    def _context(self, device: int):
        lib, check = self._lib, self._check

        class _Primary:
            def __enter__(self):
                self.dev, self.ctx = ctypes.c_int(), ctypes.c_void_p()
                check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(self.dev), device))
                check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev))
                check("cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(self.ctx))

            def __exit__(self, *exc):
                popped = ctypes.c_void_p()
                lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
                lib.cuDevicePrimaryCtxRelease_v2(self.dev)

        return _Primary()


HOST_HINT = ("build it under kvbroker_client.adapter.hostmem.SharedHostAllocations (or move it with "
             "hostmem.share_in_place) before its address is cached, or keep the KV cache on the GPU")
_VMM_HINT = ("the allocation comes from CUDA's VMM API (PyTorch's expandable segments), which has no legacy "
             "CUDA IPC handle: start the server with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, "
             "or register broker-owned memory")


class MemoryExporter:
    """Maps addresses to memory references; the process's mappings and GPU allocations are read once."""

    def __init__(self, *, host: HostMappings | None = None, cuda: CudaDriver | None | bool = True,
                 host_hint: str = HOST_HINT) -> None:
        self._host = host if host is not None else HostMappings.of_this_process()
        self._host_hint = host_hint
        self._cuda: CudaDriver | None = LibCuda.load() if cuda is True else (cuda or None)
        self._handles: dict[tuple[int, int], bytes] = {}

    def ref(self, address: int, length: int, what: str = "region") -> MemoryRef:
        """Where [address, address + length) is, as a broker opens it; NotExportable saying why not."""
        try:
            shm = self._host.ref(address, length)
        except NotExportable as exc:
            raise NotExportable(f"{what}: {exc}") from None
        if shm is not None:
            return shm
        if self._cuda is not None and (alloc := self._cuda.allocation(address)) is not None:
            return self._cuda_ref(self._cuda, address, length, alloc, what)
        gpu = "" if self._cuda is not None else " (this process has no CUDA driver, so it is not GPU memory either)"
        raise NotExportable(f"{what} at {address:#x} (+{length} bytes) is private host memory "
                            f"({self._host.explain(address)}){gpu}, which another process cannot open: "
                            f"{self._host_hint}")

    def _cuda_ref(self, cuda: CudaDriver, address: int, length: int, alloc: DeviceAllocation, what: str) -> CudaIpcRef:
        if not alloc.ipc_capable:
            raise NotExportable(f"{what} at {address:#x} on GPU {alloc.device}: {_VMM_HINT}")
        end = alloc.base + alloc.size
        if address + length > end:
            raise NotExportable(f"{what} at {address:#x} (+{length} bytes) runs past the end of its CUDA allocation "
                                f"[{alloc.base:#x}, {end:#x})")
        key = (alloc.device, alloc.base)
        if key not in self._handles:
            self._handles[key] = cuda.ipc_handle(alloc)
        return CudaIpcRef(self._handles[key], alloc.device, address - alloc.base, alloc.size)

    def is_device_memory(self, address: int) -> bool:
        """Whether `address` lies in a CUDA allocation of this process."""
        return self._cuda is not None and self._cuda.allocation(int(address)) is not None

    def refs(self, addresses: Sequence[int], lengths: Sequence[int], what: str) -> list[MemoryRef]:
        if len(addresses) != len(lengths):
            raise ValueError(f"{what}: {len(addresses)} pointers but {len(lengths)} lengths")
        return [self.ref(int(a), int(n), f"{what}[{i}]") for i, (a, n) in enumerate(zip(addresses, lengths))]
