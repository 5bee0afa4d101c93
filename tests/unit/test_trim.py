"""MemoryTrim: a collection and malloc_trim once big requests have stopped, never for small ones."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.ops.trim import MemoryTrim, TrimPolicy
from tests.support.helpers import until


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


def looks(policy: TrimPolicy, requests: list[float], until_s: float) -> list[float]:
    """Drive `policy` on a clock of its own: big requests at `requests`, a look at every time it asks
    for one; the times it decided to trim."""
    trims, look_at = [], None
    events = sorted(requests)
    now = 0.0
    while now <= until_s:
        if events and (look_at is None or events[0] <= look_at):
            now = events.pop(0)
            asked = policy.note(now)
            look_at = look_at if look_at is not None else asked
        elif look_at is not None:
            now = look_at
            look_at = policy.due(now)
            if look_at is None:
                trims.append(now)
                look_at = policy.waiting()
        else:
            break
    return trims


def test_requests_that_go_on_are_trimmed_after_the_longest_wait():
    # A request every 20 ms for 1 s: they never stop for the 0.2 s interval, so only the longest
    # wait (0.3 s from the first request since the last trim) brings the trims.
    requests = [i * 0.02 for i in range(50)]
    trims = looks(TrimPolicy(interval_s=0.2, max_wait_s=0.3), requests, until_s=2.0)
    assert trims[0] == pytest.approx(0.3, abs=0.021), trims
    assert all(0 < b - a <= 0.3 + 0.021 for a, b in zip(trims, trims[1:])), trims
    assert trims[-1] == pytest.approx(requests[-1] + 0.2), trims  # and once more after they stopped


def test_a_pause_as_long_as_the_interval_trims_at_once_and_nothing_after():
    trims = looks(TrimPolicy(interval_s=0.2, max_wait_s=10), [0.0, 0.1, 0.15], until_s=20)
    assert trims == [pytest.approx(0.35)]


async def test_requests_that_go_on_are_trimmed_on_the_loop():
    trim = MemoryTrim(interval_s=0.2, after_bytes=1, max_wait_s=0.3)

    async def go_on():
        while True:  # a request every 20 ms: they never stop for 0.2 s (TrimPolicy's tests say when it trims)
            trim.note(10)
            await asyncio.sleep(0.02)

    feeder = asyncio.create_task(go_on())
    try:
        assert await until(lambda: trim.trims >= 1, timeout=30)
    finally:
        feeder.cancel()
        trim.close()
