"""Resolving memory references into addresses this process (and its transfer engine) can use.

Host memory: `map_shared_memory` maps a named POSIX shared-memory segment (/dev/shm/<name>) that
the inference server created, read-write, until the engine unregisters. The broker never creates
or unlinks a segment: the server owns it. `segment_identity` names the file a segment name points
at, (st_dev, st_ino), so that overlap checks compare files, not names (a hard link is the same file).

A segment cannot take the broker down. The bytes are copied by the transfer engine's own threads
(UCX's progress thread, Mooncake's workers), so when the kernel cannot back a page of a mapping
(the server shrank its segment after registering it, or /dev/shm is full under a hole) the copy
raises SIGBUS, whose default action ends the broker and every engine on it. Three layers:
- `MappedSegment.reserve`, at registration: fallocate(2) of each registered buffer, so tmpfs
  blocks exist before any byte moves; a full /dev/shm is RESOURCE_EXHAUSTED then, not a SIGBUS
  later. Pages the server had not allocated are allocated (and charged) to the broker: servers
  should allocate their segments at creation, as kvbroker_client's SharedSegment does. Locking
  (mlock) would not help: truncating a tmpfs file drops its pages from every mapping, locked or not.
- `MappedSegment.check_intact` (`check_segments` for an engine), before and after each write on
  both sides and when a grant is made or claimed: one fstat of the file the broker keeps open.
  A segment shrunk below what was registered is FAILED_PRECONDITION naming it, for that engine only.
- The SIGBUS guard (kvbroker/memory/_memguard.c), for the races the check cannot see (a shrink during a
  write, pages punched out and not re-allocatable): every mapping is watched; a fault inside one
  maps zero pages over the whole mapping, so the engine's copy completes into memory nobody reads,
  and marks the segment `poisoned`, which `check_intact` then reports, failing that engine's
  transfers until it re-registers. A fault anywhere else goes to the handler installed before the
  guard (a transfer engine's) or kills the process as it would have. `map_shared_memory` installs
  the guard (`install_sigbus_guard`), again if a library replaced it since.

GPU memory: a CUDA IPC reference was checked without a GPU already (validation.check_cuda_ref);
`GpuMemory`, one per Registry, opens each server allocation once (`import_allocation`, shared by
every layer buffer and engine that names the same handle, closed when the last one lets go) and
allocates broker-owned pools (`allocate_pool`, laid out by the pure `plan_pool`). It loads the CUDA
driver on the first GPU reference; a broker without one refuses GPU references, naming the field.
Everything here is called by the Registry while it builds or releases an engine, in a worker
thread (driver calls block, the first for as long as the driver takes to initialise): GpuMemory
serialises its own state with a lock. `check_intact` and `check_segments` are called by the Broker.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvbroker.core.errors import BrokerError, Code, invalid, precondition
from kvbroker.core.model import CudaIpcRef
from kvbroker.memory import _memguard
from kvbroker.memory.cuda import CudaError, CudaUnavailable, OpenedAllocation, load_driver

log = logging.getLogger(__name__)

SEGMENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
SHM_DIR = Path("/dev/shm")
POOL_ALIGNMENT = 4096  # bytes; every layer buffer of a broker-owned pool starts on such a boundary


@dataclass
class MappedSegment:
    """A server's segment mapped into the broker, its file kept open to see it shrink, its mapping guarded."""

    name: str
    size: int  # bytes mapped: the file's size at registration
    address: int
    identity: tuple[int, int]  # (st_dev, st_ino) of the file mapped
    _fd: int = field(repr=False)
    _slot: int = field(repr=False)  # in the SIGBUS guard's table
    _mmap: mmap.mmap = field(repr=False)
    _anchor: ctypes.Array = field(repr=False)
    extent: int = 0  # bytes from the start that registered buffers cover: the file may not shrink below it
    _allocated: bool = field(default=False, repr=False)  # every page of the file was, when last reserved
    _charged_logged: bool = field(default=False, repr=False)

    def reserve(self, offset: int, length: int, field_name: str) -> None:
        """Allocate the tmpfs blocks of [offset, offset + length): a registered buffer."""
        self.extent = max(self.extent, offset + length)
        if self._allocated:
            return
        before = os.fstat(self._fd)
        if before.st_blocks * 512 >= before.st_size:  # every page allocated: fallocate would walk them for nothing
            self._allocated = True  # for the segment's other buffers too: they are registered with this one
            return
        try:
            _memguard.reserve(self._fd, offset, length)
        except OSError as exc:
            if exc.errno == errno.EOPNOTSUPP:  # not tmpfs: nothing to reserve; the guard still applies
                log.debug("segment %r: fallocate unsupported, not reserved", self.name)
            elif exc.errno == errno.ENOSPC:
                raise BrokerError(Code.RESOURCE_EXHAUSTED, (
                    f"{field_name}: /dev/shm cannot back {length} bytes at offset {offset} of segment {self.name!r} "
                    f"({_free_bytes()} bytes free): the shared-memory volume (the emptyDir's sizeLimit, or the "
                    "memory limit that bounds it) is too small for the registered buffers")) from None
            elif exc.errno == errno.ENOMEM:
                raise BrokerError(Code.RESOURCE_EXHAUSTED, (
                    f"{field_name}: the broker's memory limit cannot hold {length} bytes at offset {offset} of "
                    f"segment {self.name!r}, which its server has not allocated; allocate segments when creating "
                    "them (posix_fallocate), or raise the broker container's memory limit")) from None
            else:
                raise invalid(f"{field_name}: cannot allocate segment {self.name!r}: {exc.strerror}") from None
        added = (os.fstat(self._fd).st_blocks - before.st_blocks) * 512
        if added and not self._charged_logged:
            self._charged_logged = True
            log.warning("segment %r was not allocated by its server: the broker allocates the missing pages of "
                        "its registered buffers (%d bytes under the first), and they count against the broker's "
                        "memory; allocate segments when creating them (posix_fallocate, as kvbroker_client does)",
                        self.name, added, extra={"segment": self.name, "bytes": added})

    @property
    def poisoned(self) -> bool:
        """Whether the SIGBUS guard has replaced this mapping with zero pages."""
        return _memguard.fault(self._slot) is not None

    def check_intact(self) -> None:
        """FAILED_PRECONDITION, naming the segment, once it has shrunk below what was registered or was poisoned."""
        fault = _memguard.fault(self._slot)
        if fault is not None:
            raise precondition(
                f"shared-memory segment {self.name!r} lost its memory after registration: a transfer engine "
                f"touched byte {fault - self.address} of it and the kernel could not back that page (the segment "
                "was shrunk after registration, or a hole in it could not be allocated); the broker replaced the "
                "mapping with zero pages, so no byte that crossed it since is valid. Unregister the engine and "
                "register it over a segment that stays its size")
        size = os.fstat(self._fd).st_size
        if size < self.extent:
            raise precondition(
                f"shared-memory segment {self.name!r} was shrunk after registration: {size} bytes now, and the "
                f"registered buffers reach byte {self.extent}; nothing moves into or out of it. Unregister the "
                "engine and register it over a segment that stays its size")

    def close(self) -> None:
        _memguard.unwatch(self._slot)  # before the range is unmapped, and perhaps reused
        del self._anchor  # the ctypes view pins the mapping; drop it before unmapping
        self._mmap.close()
        os.close(self._fd)


def install_sigbus_guard() -> None:
    """Install the SIGBUS guard, unless it is the process's handler now (map_shared_memory calls this)."""
    if _memguard.ensure():
        log.debug("SIGBUS guard installed")


def segment_identity(name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of /dev/shm/<name>, not following a symlink; None when there is no such file
    (`map_shared_memory` then says what is wrong with the name)."""
    if not SEGMENT_NAME.fullmatch(name) or name in (".", ".."):
        return None
    try:
        st = os.stat(SHM_DIR / name, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def map_shared_memory(name: str, field_name: str) -> MappedSegment:
    """Map /dev/shm/<name>; `field_name` is the request field the name came from, for errors."""
    if not SEGMENT_NAME.fullmatch(name) or name in (".", ".."):
        raise invalid(f"{field_name}: segment name {name!r} must match [A-Za-z0-9._-]{{1,200}}")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise invalid(f"{field_name}: shared-memory segment {name!r} not found") from None
    except OSError as exc:
        raise invalid(f"{field_name}: cannot open shared-memory segment {name!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise invalid(f"{field_name}: shared-memory segment {name!r} is not a regular file")
        if st.st_size == 0:
            raise invalid(f"{field_name}: shared-memory segment {name!r} is empty")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    anchor = (ctypes.c_char * st.st_size).from_buffer(mm)
    address = ctypes.addressof(anchor)
    try:
        install_sigbus_guard()
        slot = _memguard.watch(address, st.st_size)
    except (OverflowError, RuntimeError) as exc:  # the guard's table is full; another handler keeps taking SIGBUS
        del anchor
        mm.close()
        os.close(fd)
        code = Code.RESOURCE_EXHAUSTED if isinstance(exc, OverflowError) else Code.FAILED_PRECONDITION
        raise BrokerError(code, f"{field_name}: cannot guard segment {name!r}: {exc}") from None
    return MappedSegment(name, st.st_size, address, (st.st_dev, st.st_ino), fd, slot, mm, anchor)


def check_segments(held: Iterable[object], engine_id: str) -> None:
    """`check_intact` for every segment an engine holds; the error names the engine."""
    for item in held:
        if isinstance(item, MappedSegment):
            try:
                item.check_intact()
            except BrokerError as exc:
                raise BrokerError(exc.code, f"engine {engine_id!r}: {exc.reason}") from None


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def plan_pool(lengths: Sequence[int], alignment: int = POOL_ALIGNMENT) -> tuple[list[int], int]:
    """Offsets of buffers laid out back to back in one pool, each aligned; and the pool's size."""
    offsets, end = [], 0
    for length in lengths:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + length
    return offsets, -(-end // alignment) * alignment


class GpuDriver(Protocol):
    """What GpuMemory needs from CUDA: kvbroker.memory.cuda.CudaDriver, or a stand-in in tests."""

    device_count: int

    def open_ipc(self, handle: bytes, device: int) -> OpenedAllocation: ...

    def close_ipc(self, address: int, device: int) -> None: ...

    def allocate(self, device: int, size: int) -> tuple[int, bytes]: ...

    def free(self, address: int, device: int) -> None: ...


@dataclass
class ImportedAllocation:
    """One server allocation opened in this process; `users` counts the engines holding it."""

    handle: bytes = field(repr=False)
    device: int
    address: int
    size: int
    users: int = 0


@dataclass
class ImportLease:
    """One engine's hold on an imported allocation; `close` lets go of it."""

    allocation: ImportedAllocation
    _owner: GpuMemory = field(repr=False)
    _open: bool = True

    @property
    def address(self) -> int:
        return self.allocation.address

    @property
    def size(self) -> int:
        return self.allocation.size

    def close(self) -> None:
        if self._open:
            self._open = False
            self._owner._let_go(self.allocation)


@dataclass
class BrokerPool:
    """GPU memory the broker allocated for one engine and exports by `handle`; `close` frees it."""

    device: int
    address: int
    size: int
    handle: bytes = field(repr=False)
    _driver: GpuDriver = field(repr=False)
    _open: bool = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._driver.free(self.address, self.device)


class GpuMemory:
    """The broker's GPU memory: imported server allocations and broker-owned pools."""

    def __init__(self, load: Callable[[], GpuDriver] = load_driver) -> None:
        self._load = load
        self._loaded: GpuDriver | None = None
        self._unavailable = ""
        self._imports: dict[tuple[int, bytes], ImportedAllocation] = {}
        self._lock = threading.RLock()  # engines are built and released from worker threads

    @property
    def imports(self) -> list[ImportedAllocation]:
        return list(self._imports.values())

    def driver(self, field_name: str) -> GpuDriver:
        """The CUDA driver, loaded on first use; without one, INVALID_ARGUMENT naming `field_name`."""
        with self._lock:
            return self._driver(field_name)

    def _driver(self, field_name: str) -> GpuDriver:
        if self._loaded is None and not self._unavailable:
            try:
                self._loaded = self._load()
            except CudaUnavailable as exc:
                self._unavailable = str(exc)
        if self._loaded is None:
            raise invalid(f"{field_name}: this broker has no CUDA support; use shared_memory ({self._unavailable})")
        return self._loaded

    def _device(self, driver: GpuDriver, device: int, field_name: str) -> None:
        if device >= driver.device_count:
            raise invalid(f"{field_name}: {device} is not a CUDA device of this broker, which sees "
                          f"{driver.device_count}; the broker and the server must see the same GPUs")

    def import_allocation(self, ref: CudaIpcRef, field_name: str) -> ImportLease:
        """Open (or share the open of) the allocation `ref` names, checked against what the driver reports."""
        with self._lock:
            return self._import(ref, field_name)

    def _import(self, ref: CudaIpcRef, field_name: str) -> ImportLease:
        driver = self._driver(field_name)
        self._device(driver, ref.device, f"{field_name}.device")
        key = (ref.device, bytes(ref.handle))
        allocation = self._imports.get(key)
        if allocation is None:
            try:
                opened = driver.open_ipc(key[1], ref.device)
            except CudaError as exc:
                raise invalid(f"{field_name}.handle: the CUDA driver cannot open it ({exc.name}); the server "
                              "must be alive on this node and the broker see its GPUs") from None
            allocation = ImportedAllocation(key[1], ref.device, opened.address, opened.size)
            if opened.device != ref.device:
                driver.close_ipc(opened.address, ref.device)
                raise invalid(f"{field_name}.device: declared {ref.device}, but the allocation is on device "
                              f"{opened.device} as this broker numbers them; give both the same "
                              "CUDA_VISIBLE_DEVICES")
            self._imports[key] = allocation
        lease = ImportLease(allocation, self)
        allocation.users += 1
        if ref.allocation_size > allocation.size:
            lease.close()
            raise invalid(f"{field_name}.allocation_size: {ref.allocation_size} bytes declared, but the "
                          f"allocation of this handle has {allocation.size}")
        return lease

    def _let_go(self, allocation: ImportedAllocation) -> None:
        with self._lock:
            allocation.users -= 1
            if allocation.users == 0:
                del self._imports[(allocation.device, allocation.handle)]
                self._driver("cuda_ipc").close_ipc(allocation.address, allocation.device)

    def allocate_pool(self, device: int, size: int, field_name: str) -> BrokerPool:
        """`size` zeroed bytes on `device`, owned by the broker and exported by IPC handle."""
        driver = self.driver(field_name)
        self._device(driver, device, field_name)
        try:
            address, handle = driver.allocate(device, size)
        except CudaError as exc:
            code = Code.RESOURCE_EXHAUSTED if exc.out_of_memory else Code.INTERNAL
            raise BrokerError(code, f"{field_name}: cannot allocate {size} bytes on CUDA device {device}: "
                                    f"{exc}") from None
        return BrokerPool(device, address, size, handle, driver)
