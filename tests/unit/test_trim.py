"""MemoryTrim: a collection and malloc_trim once big requests have stopped, never for small ones."""

from __future__ import annotations

import asyncio

from kvbroker.ops.trim import MemoryTrim
from tests.conftest import until


async def test_a_trim_follows_big_requests_once_they_stop():
    trim = MemoryTrim(interval_s=0.05, after_bytes=1000, max_wait_s=5)
    for _ in range(20):
        trim.note(5000)
    assert await until(lambda: trim.trims == 1, timeout=5)
    trim.note(5000)
    assert await until(lambda: trim.trims == 2, timeout=5)
    trim.close()


async def test_small_requests_never_trim():
    trim = MemoryTrim(interval_s=0.01, after_bytes=1000)
    trim.note(999)
    assert trim._scheduled is None and trim.trims == 0


async def test_requests_that_go_on_are_trimmed_after_the_longest_wait():
    trim = MemoryTrim(interval_s=0.2, after_bytes=1, max_wait_s=0.3)
    loop = asyncio.get_running_loop()
    ends = loop.time() + 1.0
    while loop.time() < ends and trim.trims == 0:  # a request every 20 ms: they never stop for 0.2 s
        trim.note(10)
        await asyncio.sleep(0.02)
    assert trim.trims >= 1
    trim.close()
