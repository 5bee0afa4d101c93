"""A dedicated asyncio loop on its own thread, for a synchronous caller (an engine's scheduler or worker).

    loop = LoopThread("kvbroker prefill-0/tp0")
    loop.run(coro, timeout=30)          block for a result, bounded (startup, shutdown)
    task = loop.spawn(coro, name=...)   fire and forget: a Task the loop owns until it ends
    task.cancel()                       ask it to stop (thread-safe: a concurrent.futures.Future)
    loop.close(timeout=10)              cancel every task still running, then stop and join

The thread is `kvbroker-loop` to the kernel (top -H, the serving bench's per-thread figures).
Every task started here is tracked until it ends, so close() leaves none behind; a task's
exception is logged where nothing awaits it. The engine never waits on the loop except through
`run`, with a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


KERNEL_NAME = b"kvbroker-loop"  # the thread's name in top -H and /proc/<pid>/task/*/comm (15 bytes at most)


def _kernel_name(name: bytes) -> None:
    """Name the calling thread for the kernel (Python 3.11 names none); best effort."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux
        pass


class LoopClosed(RuntimeError):
    """The loop was closed; nothing more runs on it."""


class LoopThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _main(self, started: threading.Event) -> None:
        _kernel_name(KERNEL_NAME)
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
        """Run `coro` on the loop and wait for it, at most `timeout` seconds (then it is cancelled)."""
        future = self._submit(self._owned(coro))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: no answer within {timeout}s") from None

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> concurrent.futures.Future:
        """Start `coro` as a task of the loop; the returned future ends when it does."""
        return self._submit(self._owned(coro, name=name, log_errors=True))

    def call(self, fn, *args) -> None:
        """Run a plain callable on the loop thread, soon."""
        if self._closed:
            raise LoopClosed(f"{self.name} is closed")
        self._loop.call_soon_threadsafe(fn, *args)

    def _submit(self, coro) -> concurrent.futures.Future:
        if self._closed:
            coro.close()
            raise LoopClosed(f"{self.name} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _owned(self, coro, *, name: str | None = None, log_errors: bool = False):
        task = asyncio.current_task()
        assert task is not None  # a coroutine of this loop's, run as a task
        if name is not None:
            task.set_name(name)
        self._tasks.add(task)
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            if log_errors:
                log.exception("%s: task %s failed", self.name, name)
            raise
        finally:
            self._tasks.discard(task)

    def close(self, *, timeout: float = 10.0, before_stop: Coroutine | None = None) -> None:
        """Cancel every task, run `before_stop` (e.g. closing a client), stop the loop, join the thread."""
        if self._closed:
            if before_stop is not None:
                before_stop.close()
            return
        self._closed = True

        async def shutdown() -> None:
            tasks = [t for t in self._tasks if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
            if before_stop is not None:
                await asyncio.wait_for(before_stop, timeout)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(2 * timeout + 1)
        except Exception:  # noqa: BLE001 - shutting down: say so, and stop the loop anyway
            log.exception("%s: shutdown did not complete", self.name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
