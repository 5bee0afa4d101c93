"""Layer buffers from the arrays an inference server already holds: no pointer arithmetic for callers.

    pool = SharedPool(size)                        # one /dev/shm segment, carved into aligned regions
    k = [pool.torch((num_pages, page_size, heads, dim), torch.bfloat16) for _ in layers]   # or pool.numpy
    spec = kv_split_component(k, v, segments=pool)                   # MAIN_KV, K and V per layer
    index = flat_component(idx, layer_ids=sparse, segments=pool, component=Component.MINIMAX_INDEX_K)

A buffer is a C-contiguous [num_pages, ...] array or tensor: item_len (one page's bytes) is
`x[0].nbytes` unless given. `SegmentMap` turns any address range inside a known segment into
(segment name, offset); it is also what the SGLang adapter uses for raw pointers. Tensors in
torch's own shared memory (`share_memory_()` under the "file_system" sharing strategy) resolve
without a segment. torch is imported only when a torch tensor is made or passed in.

GPU memory: a CUDA tensor resolves to a CudaIpcRef (`cuda_ipc_ref`), from torch's own CUDA IPC
export (`torch.multiprocessing.reductions.reduce_tensor`): the 64-byte cudaIpcMemHandle_t of the
caching allocator's block the tensor lives in, and the tensor's offset in it. No segment is needed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbroker_client.model import (
    BufferRole,
    Component,
    ComponentSpec,
    CudaIpcRef,
    KvDtype,
    LayerBuffer,
    Layout,
    MemoryRef,
    SharedMemoryRef,
)
from kvbroker_client.shm import SharedSegment

ArrayLike = Any  # numpy.ndarray or torch.Tensor; torch stays an optional dependency


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError("torch is not installed; install kvbroker-client[torch] or use numpy arrays") from exc
    return torch


def _is_torch(x: object) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported already
    return torch is not None and isinstance(x, torch.Tensor)


@dataclass(frozen=True)
class _Extent:
    address: int
    nbytes: int
    page0_nbytes: int  # bytes of x[0]: one page for a [num_pages, ...] buffer


def _extent(x: ArrayLike) -> _Extent:
    if _is_torch(x):
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor on device {x.device}: only CPU tensors in shared memory and CUDA tensors "
                             "can be registered")
        if not x.is_contiguous():
            raise ValueError("tensor is not contiguous; a layer buffer must be one contiguous region")
        nbytes = x.numel() * x.element_size()
        return _Extent(x.data_ptr(), nbytes, nbytes // x.shape[0] if x.dim() else nbytes)
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("array is not C-contiguous; a layer buffer must be one contiguous region")
        return _Extent(x.__array_interface__["data"][0], x.nbytes, x.nbytes // x.shape[0] if x.ndim else x.nbytes)
    raise TypeError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")


IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)


def ipc_mem_handle(storage_handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t inside a torch CUDA storage handle.

    torch writes a version byte, a type byte and the payload; type 'c' (a cudaMalloc block) carries
    the 64-byte handle, which is all a broker needs. Older torch wrote the bare 64 bytes. Type 'e'
    (expandable segments) carries no cudaIpcMemHandle_t at all.
    """
    handle = bytes(storage_handle)
    if len(handle) == IPC_HANDLE_SIZE:
        return handle
    if len(handle) == IPC_HANDLE_SIZE + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError("the tensor is in an expandable segment, which has no CUDA IPC handle a broker can open; "
                         "allocate the KV cache with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    raise ValueError(f"unrecognised torch CUDA storage handle of {len(handle)} bytes")


def cuda_ipc_ref_from_reduction(rebuild_args: Sequence[Any], tensor_offset_bytes: int) -> CudaIpcRef:
    """The CudaIpcRef of the arguments torch's reduce_tensor gives to rebuild_cuda_tensor.

    Those carry the device, the storage handle, the storage's size and its offset in the block;
    `tensor_offset_bytes` is the tensor's own offset in its storage. allocation_size is the end of
    the storage in the block: what this tensor's owner vouches for, never more than the block.
    """
    device, storage_handle, storage_size, storage_offset = rebuild_args[6:10]
    return CudaIpcRef(ipc_mem_handle(storage_handle), int(device), storage_offset + tensor_offset_bytes,
                      storage_offset + storage_size)


def cuda_ipc_ref(tensor) -> CudaIpcRef:
    """Where a CUDA tensor's bytes are, as a CUDA IPC reference a broker opens once at registration.

    torch counts the consumers of a shared block and keeps it out of its cache until they release
    it; a broker never does, so the block of a registered tensor is not reused by torch's allocator
    for the life of the process, even after the tensor is freed (a KV cache lives that long anyway).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"tensor on {tensor.device} is not a CUDA tensor")
    rebuild, args = reduce_tensor(tensor.detach())
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"torch shared the CUDA tensor through {rebuild.__name__}, not rebuild_cuda_tensor")
    return cuda_ipc_ref_from_reduction(args, tensor.storage_offset() * tensor.element_size())


def _segment_address(segment: SharedSegment) -> int:
    return segment.array.__array_interface__["data"][0]


class SegmentMap:
    """Known shared-memory segments by address range: resolves an address range to (name, offset)."""

    def __init__(self, segments: Iterable[SharedSegment | SharedPool] = ()) -> None:
        self._ranges: list[tuple[int, int, str]] = []  # (start, end, name)
        for segment in segments:
            self.add(segment)

    @classmethod
    def of(cls, segments: SegmentMap | SharedSegment | SharedPool | Iterable | None) -> SegmentMap:
        if isinstance(segments, SegmentMap):
            return segments
        if segments is None:
            return cls()
        if isinstance(segments, SharedSegment | SharedPool):
            return cls([segments])
        return cls(segments)

    def add(self, segment: SharedSegment | SharedPool) -> None:
        seg = segment.segment if isinstance(segment, SharedPool) else segment
        start = _segment_address(seg)
        self._ranges.append((start, start + seg.size, seg.name))

    def resolve(self, address: int, length: int) -> SharedMemoryRef:
        """The segment and offset of [address, address + length); ValueError when no segment holds it all."""
        for start, end, name in self._ranges:
            if start <= address < end:
                if address + length > end:
                    raise ValueError(f"region [{address:#x}, +{length}) runs past the end of segment {name!r} "
                                     f"([{start:#x}, {end:#x}))")
                return SharedMemoryRef(name, address - start)
        known = ", ".join(f"{n} [{s:#x}, {e:#x})" for s, e, n in self._ranges) or "none"
        raise ValueError(f"address {address:#x} (+{length} bytes) is in no known shared-memory segment "
                         f"(known: {known}); allocate the buffer from a SharedPool or pass its segment")


def _torch_shared_ref(tensor) -> SharedMemoryRef | None:
    """Where a CPU tensor in torch's own shared memory lives, when torch gave it a /dev/shm name."""
    storage = tensor.untyped_storage()
    if not storage.is_shared():
        return None
    torch = _torch()
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        raise ValueError("tensor is in torch shared memory under the 'file_descriptor' strategy, which has no "
                         "name a broker can open; allocate it from a SharedPool, or call "
                         "torch.multiprocessing.set_sharing_strategy('file_system') before share_memory_()")
    _, filename, size = storage._share_filename_cpu_()
    name = (filename.decode() if isinstance(filename, bytes) else filename).lstrip("/")
    header = os.stat(f"/dev/shm/{name}").st_size - size  # torch keeps a refcount header before the data
    if not 0 <= header <= 4096:
        raise ValueError(f"unexpected layout of torch shared-memory file {name!r}")
    return SharedMemoryRef(name, header + tensor.data_ptr() - storage.data_ptr())


def memory_ref(x: ArrayLike, segments: SegmentMap | SharedSegment | SharedPool | Iterable | None = None
               ) -> MemoryRef:
    """Where the bytes of `x` live, as a broker names them."""
    extent = _extent(x)
    if _is_torch(x) and x.device.type == "cuda":
        return cuda_ipc_ref(x)
    segment_map = SegmentMap.of(segments)
    try:
        return segment_map.resolve(extent.address, extent.nbytes)
    except ValueError:
        if _is_torch(x) and (ref := _torch_shared_ref(x)) is not None:
            return ref
        raise


def layer_buffer(x: ArrayLike, layer_id: int, role: BufferRole = BufferRole.FLAT, *,
                 segments: SegmentMap | SharedSegment | SharedPool | Iterable | None = None,
                 item_len: int | None = None) -> LayerBuffer:
    """One layer buffer over a contiguous [num_pages, ...] array; item_len defaults to x[0].nbytes."""
    extent = _extent(x)
    item = extent.page0_nbytes if item_len is None else item_len
    if item <= 0 or extent.nbytes < item:
        raise ValueError(f"layer {layer_id} {role.name}: {extent.nbytes} bytes hold no page of {item} bytes")
    return LayerBuffer(layer_id, BufferRole(role), memory_ref(x, segments), extent.nbytes, item)


def _component(component: Component | int | str, layout: Layout, buffers: list[LayerBuffer]) -> ComponentSpec:
    if not buffers:
        raise ValueError("a component needs at least one layer buffer")
    return ComponentSpec(Component.of(component), layout, min(b.num_pages for b in buffers), tuple(buffers))


def _layer_ids(count: int, layer_ids: Sequence[int] | None, start_layer: int) -> list[int]:
    ids = list(range(start_layer, start_layer + count)) if layer_ids is None else [int(i) for i in layer_ids]
    if len(ids) != count:
        raise ValueError(f"{count} buffers but {len(ids)} layer ids")
    return ids


def kv_split_component(k: Sequence[ArrayLike], v: Sequence[ArrayLike], *,
                       segments: SegmentMap | SharedSegment | SharedPool | Iterable | None = None,
                       layer_ids: Sequence[int] | None = None, start_layer: int = 0,
                       component: Component | int | str = Component.MAIN_KV,
                       item_len: int | None = None) -> ComponentSpec:
    """A KV_SPLIT component (MHA): k[i] and v[i] are the K and V buffers of layer layer_ids[i]."""
    if len(k) != len(v):
        raise ValueError(f"{len(k)} K buffers but {len(v)} V buffers")
    ids = _layer_ids(len(k), layer_ids, start_layer)
    segment_map = SegmentMap.of(segments)
    buffers = []
    for layer, k_buf, v_buf in zip(ids, k, v):
        buffers.append(layer_buffer(k_buf, layer, BufferRole.K, segments=segment_map, item_len=item_len))
        buffers.append(layer_buffer(v_buf, layer, BufferRole.V, segments=segment_map, item_len=item_len))
    return _component(component, Layout.KV_SPLIT, buffers)


def flat_component(buffers: Sequence[ArrayLike], *,
                   segments: SegmentMap | SharedSegment | SharedPool | Iterable | None = None,
                   layer_ids: Sequence[int] | None = None, start_layer: int = 0,
                   component: Component | int | str = Component.MAIN_KV,
                   item_len: int | None = None) -> ComponentSpec:
    """A FLAT component: one buffer per layer (MLA latent; MINIMAX_INDEX_K on the sparse layers)."""
    ids = _layer_ids(len(buffers), layer_ids, start_layer)
    segment_map = SegmentMap.of(segments)
    return _component(component, Layout.FLAT, [
        layer_buffer(buf, layer, BufferRole.FLAT, segments=segment_map, item_len=item_len)
        for layer, buf in zip(ids, buffers)
    ])


_KV_DTYPES = {
    "float32": KvDtype.FLOAT32, "float16": KvDtype.FLOAT16, "bfloat16": KvDtype.BFLOAT16,
    "float8_e4m3fn": KvDtype.FLOAT8_E4M3, "float8_e5m2": KvDtype.FLOAT8_E5M2,
    "int8": KvDtype.INT8, "uint8": KvDtype.UINT8,
}


def kv_dtype(dtype) -> KvDtype:
    """The KvDtype of a torch or numpy dtype (torch.bfloat16, np.float16, "float8_e4m3fn", ...)."""
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, np.dtype | type) else np.dtype(dtype).name
    try:
        return _KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no kvbroker KvDtype; one of {sorted(_KV_DTYPES)}") from None


class SharedPool:
    """One shared-memory segment that hands out aligned numpy arrays and torch tensors.

    The server owns it: `close()` unmaps and unlinks the segment (a broker that still maps it keeps
    its own mapping until the engine unregisters). Arrays handed out must not be used after close.
    Every page is allocated at creation (OSError ENOSPC when /dev/shm is too small), and the segment
    keeps its size: see kvbroker_client.shm.
    """

    def __init__(self, size: int, *, prefix: str = "kvbroker", alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.segment = SharedSegment.create(size, prefix)
        self.alignment = alignment
        self._used = 0

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def size(self) -> int:
        return self.segment.size

    @property
    def used(self) -> int:
        return self._used

    @property
    def bytes(self) -> np.ndarray:
        """The whole segment as uint8."""
        return self.segment.array

    def allocate(self, nbytes: int) -> tuple[int, np.ndarray]:
        """An aligned region of `nbytes`: its offset and a uint8 view of it."""
        offset = -(-self._used // self.alignment) * self.alignment
        if nbytes <= 0 or offset + nbytes > self.size:
            raise MemoryError(f"pool {self.name!r}: cannot allocate {nbytes} bytes at offset {offset} "
                              f"in {self.size} bytes")
        self._used = offset + nbytes
        return offset, self.segment.array[offset:offset + nbytes]

    def numpy(self, shape: int | Sequence[int], dtype=np.uint8) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        _, raw = self.allocate(int(np.prod(shape)) * dtype.itemsize)
        return raw.view(dtype).reshape(shape)

    def torch(self, shape: int | Sequence[int], dtype=None):
        """A CPU tensor in the pool (torch.uint8 unless `dtype`); torch dtypes numpy lacks work too."""
        torch = _torch()
        dtype = torch.uint8 if dtype is None else dtype
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        _, raw = self.allocate(int(np.prod(shape)) * itemsize)
        return torch.from_numpy(raw).view(dtype).view(shape)

    def ref(self, x: ArrayLike) -> SharedMemoryRef:
        extent = _extent(x)
        return SegmentMap([self]).resolve(extent.address, extent.nbytes)

    def close(self) -> None:
        try:
            self.segment.close()
        except BufferError:
            pass  # arrays handed out still reference the mapping; it goes when they do
        self.segment.unlink()

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["SegmentMap", "SharedPool", "cuda_ipc_ref", "cuda_ipc_ref_from_reduction", "flat_component",
           "ipc_mem_handle", "kv_dtype", "kv_split_component", "layer_buffer", "memory_ref"]
