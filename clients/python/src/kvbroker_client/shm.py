"""Shared-memory segments the way an inference server hands them to its broker.

The server creates a segment under /dev/shm, places its layer buffers in it at offsets, and
registers them by (segment name, offset). The broker maps the same segment; the server keeps
ownership and unlinks it when done.
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
        fd = os.open(f"/dev/shm/{name}", flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(cls, size: int, prefix: str = "kvbroker") -> SharedSegment:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size)

    def close(self) -> None:
        self.array = None  # release the buffer export before unmapping
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
