"""Segments as kvbroker_client creates them: every page allocated up front, the server's to pay for."""

from __future__ import annotations

import errno
import os

import pytest

from kvbroker_client.shm import SharedSegment
from kvbroker_client.tensors import SharedPool


def test_a_new_segment_has_every_page_allocated():
    with SharedSegment.create(3 << 20, "kvbct") as segment:
        assert os.stat(f"/dev/shm/{segment.name}").st_blocks * 512 >= 3 << 20


def test_a_pool_larger_than_dev_shm_fails_at_creation_and_leaves_no_segment():
    free = os.statvfs("/dev/shm")
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError) as info:
        SharedPool(free.f_blocks * free.f_frsize + (1 << 30), prefix="kvbct-huge")
    assert info.value.errno == errno.ENOSPC and "cannot allocate shared-memory segment" in str(info.value)
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvbct-huge")]
