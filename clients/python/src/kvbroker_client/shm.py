"""Shared-memory segments the way an inference server hands them to its broker.

The server creates a segment under /dev/shm, places its layer buffers in it at offsets, and
registers them by (segment name, offset). The broker maps the same segment; the server keeps
ownership and unlinks it when done.

A segment is allocated when it is created (posix_fallocate), not page by page as it is first
touched: its memory counts against the server's limits, not the broker's, and a /dev/shm too small
for it fails here with ENOSPC rather than with SIGBUS in the server or the broker later. A segment
must keep its size while any engine registered over it: a broker fails the transfers of an engine
whose segment shrank (FAILED_PRECONDITION), so unregister first.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np


class SharedSegment:
    """A named POSIX shared-memory segment with a uint8 numpy view over all of it."""

    def __init__(self, name: str, size: int, *, create: bool = True) -> None:
        if size <= 0:
            raise ValueError("size must be positive")
        self.name = name
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        path = f"/dev/shm/{name}"
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                _allocate(fd, path, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def array(self) -> np.ndarray:
        """A uint8 view of the whole segment, while it is open."""
        if self._array is None:
            raise ValueError(f"shared-memory segment {self.name} is closed")
        return self._array

    @classmethod
    def create(cls, size: int, prefix: str = "kvbroker") -> SharedSegment:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size)

    def close(self) -> None:
        self._array = None  # release the buffer export before unmapping
        self._mmap.close()

    def unlink(self) -> None:
        try:
            os.unlink(f"/dev/shm/{self.name}")
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.unlink()


def _allocate(fd: int, path: str, size: int) -> None:
    """Size a new segment and allocate every page of it; on failure, remove it."""
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.unlink(path)
        raise OSError(exc.errno, f"cannot allocate shared-memory segment {path} of {size} bytes: {exc.strerror} "
                                 "(is /dev/shm large enough?)") from None
    except BaseException:
        os.unlink(path)
        raise
