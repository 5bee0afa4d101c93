"""capture_signals: the first signal asks for a drain, and the handlers found before come back after."""

from __future__ import annotations

import asyncio
import os
import signal

from kvbroker.server import capture_signals


async def test_the_first_signal_sets_stop_and_the_previous_handlers_are_put_back():
    def mine(signum, frame) -> None: ...

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        stop = asyncio.Event()
        with capture_signals(stop, (signal.SIGUSR1,)):
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.wait_for(stop.wait(), 5)
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous)
