"""nixl_progress_poll_ms reaches NIXL's progress thread: an idle agent's own threads wake about once per
period (NIXL's poll() timeout), so a longer period means fewer wake-ups of an idle broker. Real NIXL
agents, one after another in this process; the agent's threads are those that appear when it starts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from kvbroker.backends import backend_options
from kvbroker.backends.nixl import NixlBackend
from kvbroker.config import Settings

IDLE_S = 0.5


def _slices(tids: set[int]) -> int:
    """Times the threads `tids` were scheduled so far (the third field of their schedstat)."""
    total = 0
    for tid in tids:
        path = Path(f"/proc/{os.getpid()}/task/{tid}/schedstat")
        if path.exists():
            total += int(path.read_text().split()[2])
    return total


def _threads() -> set[int]:
    return {int(t.name) for t in Path(f"/proc/{os.getpid()}/task").iterdir()}


async def _idle_wakeups(poll_ms: int) -> int:
    before = _threads()
    backend = NixlBackend(backend_options(Settings(nixl_progress_poll_ms=poll_ms), f"poll-{poll_ms}"))
    await backend.start()
    try:
        engine = _threads() - before  # the agent's threads, and the NIXL call thread
        first = _slices(engine)
        await asyncio.sleep(IDLE_S)  # the span measured, not a wait for an event
        return _slices(engine) - first
    finally:
        await backend.close()


async def test_a_longer_poll_period_wakes_an_idle_agent_less():
    every_ms = await _idle_wakeups(1)
    every_100ms = await _idle_wakeups(100)
    assert every_ms >= 50, f"an idle agent polling every 1 ms woke {every_ms} times in {IDLE_S} s"
    assert every_100ms * 5 <= every_ms, (every_ms, every_100ms)
