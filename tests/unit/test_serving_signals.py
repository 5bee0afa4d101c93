"""A demo or benchmark stopped by SIGTERM or SIGINT ends through its blocks, which stop what they
started (compare.run_stopping_on_signals), and exits 130."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

CHILD = """
import asyncio, contextlib, sys
from pathlib import Path
from kvbroker_tools.serving import compare

class Deployment:
    async def stop(self):
        Path(sys.argv[1]).write_text("stopped")

async def main():
    async with compare.started({"one": lambda: asyncio.sleep(0, Deployment())}):
        print("ready", flush=True)
        await asyncio.sleep(3600)

compare.run_stopping_on_signals(main())
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_what_the_run_started_and_exits_130(tmp_path, signum):
    marker = tmp_path / "stopped"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signum)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, err
    assert marker.read_text() == "stopped", "the deployment the run started was not stopped"
    assert "interrupted" in err
