"""The few CUDA driver calls the broker makes, through ctypes on libcuda.so.1.

`load_driver` returns a `CudaDriver` or raises `CudaUnavailable` (no driver library, no device).
memory.py is the only caller: it opens servers' IPC handles (`open_ipc`/`close_ipc`) and allocates
broker-owned pools (`allocate`/`free`). Every call runs in the device's primary context, pushed
for the call and popped after, so any thread may call and the transfer engines (UCX, Mooncake),
which use the runtime API and therefore the primary contexts, see the same mappings.

Why the driver API through ctypes, and not torch's `rebuild_cuda_tensor` or cuda-python: the
broker image then needs neither torch nor another wheel (libcuda.so.1 is what the NVIDIA container
runtime injects on every GPU node), and the wire format is the 64-byte cudaIpcMemHandle_t, which
any server can produce, instead of torch's versioned storage handle and its reference-counting
protocol, which tie the broker to the server's torch version.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvbroker.core.validation import IPC_HANDLE_SIZE

_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_POINTER_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY

_CUdeviceptr = ctypes.c_uint64


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class CudaUnavailable(Exception):
    """This process cannot use CUDA; the message says why (no driver, no device, cuInit failed)."""


class CudaError(Exception):
    """A driver call failed; `name` is the driver's error name (CUDA_ERROR_...)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.code = code
        self.name = name

    @property
    def out_of_memory(self) -> bool:
        return self.code == _OUT_OF_MEMORY


@dataclass(frozen=True)
class OpenedAllocation:
    """A server's allocation mapped into this process."""

    address: int  # where its first byte is mapped here
    size: int  # bytes of the whole allocation, as the driver reports it
    device: int  # ordinal of the GPU that holds it, as this process numbers them


class CudaDriver:
    """libcuda.so.1, initialised, with the primary context of each device it was asked about retained."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._fn = {name: _bind(lib, symbol, args) for name, (symbol, args) in _SIGNATURES.items()}
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        self.device_count = count.value

    def _call(self, name: str, *args) -> None:
        code = self._fn[name](*args)
        if code != 0:
            raise CudaError(name, code, _error_name(self._lib, code))

    @contextmanager
    def _on(self, device: int) -> Iterator[None]:
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                dev = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(dev), device)
                ctx = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
                self._contexts[device] = ctx
        self._call("cuCtxPushCurrent", ctx)
        try:
            yield
        finally:
            self._fn["cuCtxPopCurrent"](ctypes.byref(ctypes.c_void_p()))

    def open_ipc(self, handle: bytes, device: int) -> OpenedAllocation:
        """Map another process's allocation into this one, in `device`'s context."""
        with self._on(device):
            ptr = _CUdeviceptr()
            self._call("cuIpcOpenMemHandle", ctypes.byref(ptr), _IpcMemHandle.from_buffer_copy(handle),
                       _LAZY_ENABLE_PEER_ACCESS)
            try:
                base, size, ordinal = _CUdeviceptr(), ctypes.c_size_t(), ctypes.c_int()
                self._call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ptr)
                self._call("cuPointerGetAttribute", ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, ptr)
            except BaseException:
                self._fn["cuIpcCloseMemHandle"](ptr)
                raise
            return OpenedAllocation(ptr.value, size.value - (ptr.value - base.value), ordinal.value)

    def close_ipc(self, address: int, device: int) -> None:
        with self._on(device):
            self._call("cuIpcCloseMemHandle", _CUdeviceptr(address))

    def allocate(self, device: int, size: int) -> tuple[int, bytes]:
        """`size` zeroed bytes on `device`, and the IPC handle that exports them."""
        with self._on(device):
            ptr = _CUdeviceptr()
            self._call("cuMemAlloc", ctypes.byref(ptr), size)
            try:
                self._call("cuMemsetD8", ptr, 0, size)
                self._call("cuCtxSynchronize")
                raw = _IpcMemHandle()
                self._call("cuIpcGetMemHandle", ctypes.byref(raw), ptr)
            except BaseException:
                self._fn["cuMemFree"](ptr)
                raise
            return ptr.value, bytes(raw)

    def free(self, address: int, device: int) -> None:
        with self._on(device):
            self._call("cuMemFree", _CUdeviceptr(address))


_P = ctypes.c_void_p  # out-parameters are passed by reference
# Each call's entry point by its exact symbol: cuda.h maps some plain names to a `_v2` of the same
# signature (cuMemAlloc), but CUDA 13's cuCtxSynchronize_v2 takes a context argument that the plain
# cuCtxSynchronize has not, so "_v2 where it exists" would call it with garbage (seen on an H200:
# CUDA_ERROR_CONTEXT_IS_DESTROYED at the first broker-owned allocation).
_SIGNATURES = {
    "cuDeviceGetCount": ("cuDeviceGetCount", (_P,)),
    "cuDeviceGet": ("cuDeviceGet", (_P, ctypes.c_int)),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", (_P, ctypes.c_int)),
    "cuCtxPushCurrent": ("cuCtxPushCurrent_v2", (ctypes.c_void_p,)),
    "cuCtxPopCurrent": ("cuCtxPopCurrent_v2", (_P,)),
    "cuIpcOpenMemHandle": ("cuIpcOpenMemHandle_v2", (_P, _IpcMemHandle, ctypes.c_uint)),
    "cuIpcCloseMemHandle": ("cuIpcCloseMemHandle", (_CUdeviceptr,)),
    "cuIpcGetMemHandle": ("cuIpcGetMemHandle", (_P, _CUdeviceptr)),
    "cuMemGetAddressRange": ("cuMemGetAddressRange_v2", (_P, _P, _CUdeviceptr)),
    "cuPointerGetAttribute": ("cuPointerGetAttribute", (_P, ctypes.c_int, _CUdeviceptr)),
    "cuMemAlloc": ("cuMemAlloc_v2", (_P, ctypes.c_size_t)),
    "cuMemsetD8": ("cuMemsetD8_v2", (_CUdeviceptr, ctypes.c_ubyte, ctypes.c_size_t)),
    "cuMemFree": ("cuMemFree_v2", (_CUdeviceptr,)),
    "cuCtxSynchronize": ("cuCtxSynchronize", ()),
}


def _bind(lib: ctypes.CDLL, symbol: str, argtypes: tuple):
    fn = getattr(lib, symbol, None)
    if fn is None:
        raise CudaUnavailable(f"libcuda.so.1 has no {symbol}")
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _error_name(lib: ctypes.CDLL, code: int) -> str:
    text = ctypes.c_char_p()
    if lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
        return text.value.decode()
    return f"CUresult {code}"


def load_driver() -> CudaDriver:
    """The CUDA driver of this node, initialised; CudaUnavailable says why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaUnavailable(f"libcuda.so.1 cannot be loaded (no NVIDIA driver in this container): {exc}") from None
    code = lib.cuInit(0)
    if code != 0:
        raise CudaUnavailable(f"cuInit failed: {_error_name(lib, code)}")
    driver = CudaDriver(lib)
    if driver.device_count == 0:
        raise CudaUnavailable("the CUDA driver reports no device")
    return driver
