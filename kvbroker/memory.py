"""Resolving memory references into addresses this process (and its transfer engine) can use.

Host memory: a named POSIX shared-memory segment (/dev/shm/<name>) that the inference server
created; the broker maps it read-write and keeps it mapped until the engine unregisters. The
broker never creates or unlinks a segment: the server owns it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvbroker.errors import invalid

SEGMENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
SHM_DIR = Path("/dev/shm")


@dataclass
class MappedSegment:
    name: str
    size: int
    address: int
    _mmap: mmap.mmap = field(repr=False)
    _anchor: ctypes.Array = field(repr=False)

    def close(self) -> None:
        del self._anchor  # the ctypes view pins the mapping; drop it before unmapping
        self._mmap.close()


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
        size = os.fstat(fd).st_size
        if size == 0:
            raise invalid(f"{field_name}: shared-memory segment {name!r} is empty")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    anchor = (ctypes.c_char * size).from_buffer(mm)
    return MappedSegment(name, size, ctypes.addressof(anchor), mm, anchor)
