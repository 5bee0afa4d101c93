"""The adapter's loop thread is `kvbroker-loop` to the kernel, so top -H and the serving bench's
per-thread figures tell it from the engine's scheduler threads."""

from __future__ import annotations

import threading
from pathlib import Path

from kvbroker_client.adapter.loop import LoopThread


def test_the_loop_thread_carries_its_kernel_name():
    loop = LoopThread("kvbroker prefill-0/tp0")
    try:
        async def native_id() -> int:
            return threading.get_native_id()

        tid = loop.run(native_id(), timeout=30)
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "kvbroker-loop"
    finally:
        loop.close(timeout=10)
