"""nixl_progress_poll_ms reaches NIXL's progress thread: an idle agent's own threads wake about once per
period (NIXL's poll() timeout), so a longer period means fewer wake-ups of an idle broker. Each agent
is a real NIXL agent in a child process of its own (a process that built a NIXL agent can crash in
UCX's libnl teardown at exit, which must not be pytest's); the agent's threads are those that appear
when it starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from kvbroker.config import Settings

IDLE_S = 0.5

CHILD = f"""
import asyncio, os, sys
from pathlib import Path
from kvbroker.backends import backend_options
from kvbroker.backends.nixl import NixlBackend
from kvbroker.config import Settings

def threads():
    return {{int(t.name) for t in Path(f"/proc/{{os.getpid()}}/task").iterdir()}}

def slices(tids):
    total = 0
    for tid in tids:
        path = Path(f"/proc/{{os.getpid()}}/task/{{tid}}/schedstat")
        if path.exists():
            total += int(path.read_text().split()[2])
    return total

async def main(poll_ms):
    before = threads()
    backend = NixlBackend(backend_options(Settings(nixl_progress_poll_ms=poll_ms), f"poll-{{poll_ms}}"))
    await backend.start()
    engine = threads() - before  # the agent's threads, and the NIXL call thread
    first = slices(engine)
    await asyncio.sleep({IDLE_S})  # the span measured, not a wait for an event
    woke = slices(engine) - first
    await backend.close()
    return woke

print(asyncio.run(main(int(sys.argv[1]))), flush=True)
os._exit(0)  # past UCX's teardown: the figure is out
"""


def _idle_wakeups(poll_ms: int) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD, str(poll_ms)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the NIXL child exited {done.returncode}: {done.stderr[-2000:]}"
    return int(done.stdout.split()[-1])


def test_a_longer_poll_period_wakes_an_idle_agent_less():
    every_ms = _idle_wakeups(1)
    every_100ms = _idle_wakeups(100)
    assert every_ms >= 50, f"an idle agent polling every 1 ms woke {every_ms} times in {IDLE_S} s"
    assert every_100ms * 5 <= every_ms, (every_ms, every_100ms)


def test_the_period_is_bounded_before_any_agent_is_built():
    for wrong in (0, -1, 1001):
        with pytest.raises(ValidationError, match="nixl_progress_poll_ms"):
            Settings(nixl_progress_poll_ms=wrong)
    assert Settings(nixl_progress_poll_ms=1000).nixl_progress_poll_ms == 1000
