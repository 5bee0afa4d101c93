"""Replies on their way out of one stream, bounded (STYLE.md: every stream has two bounds and an end).

Every stream the broker writes (Exchange, WatchTransfer, OpenSession, the peer NotifyStream) writes
through one `Outbox`, built from `StreamBounds` (server.py: from the Settings):
- `put(reply)` queues a reply, waiting (first come, first served) while the outbox holds
  max_stream_replies replies or max_stream_reply_bytes bytes, the one being written included; a
  reply larger than the byte bound alone goes once the outbox is empty;
- `room()` waits until the outbox is below its bound: a stream's reader awaits it before it reads
  the next message, so that a client that does not read its replies stops having its commands read;
- `flush()` waits until every reply queued has been written;
- its writer, a task of its own, is the only caller of `context.write`: a handler never waits on a
  write itself, so a client that goes under a write ends the handler as a cancellation (a debug
  line), not as grpc's ExecuteBatchError (an ERROR line);
- a write not done within stream_stall_s (the client left the stream's window full that long) ends
  the outbox `stalled`: RESOURCE_EXHAUSTED naming the setting; a write that fails (the client went)
  ends it too. `ended` is set either way, every waiter raises `Ended`, the writer stops.
`serve` runs a streaming handler's work (a pump that puts replies) through an outbox and ends the
call as the outbox ended: a stalled stream with RESOURCE_EXHAUSTED, without waiting for its client.
`StreamObserver` is what the metrics are told (ops/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import Message

from kvbroker.core.errors import BrokerError, Code
from kvbroker.edge.codes import details, status_code

log = logging.getLogger(__name__)

GONE_WAIT_S = 1.0  # after a failed write, how long a handler waits for grpc to tell it the client went


@dataclass(frozen=True)
class StreamBounds:
    """What one stream may hold of replies its client has not read (Settings: max_stream_replies,
    max_stream_reply_bytes, stream_stall_s)."""

    max_replies: int = 256
    max_bytes: int = 4 << 20
    stall_s: float = 30.0

    @classmethod
    def from_settings(cls, settings) -> StreamBounds:
        return cls(settings.max_stream_replies, settings.max_stream_reply_bytes, settings.stream_stall_s)


class StreamObserver(Protocol):
    def stream_opened(self, stream: str) -> None: ...

    def stream_closed(self, stream: str) -> None: ...

    def replies_held(self, stream: str, replies: int, nbytes: int) -> None: ...  # changes, not totals

    def stream_stalled(self, stream: str) -> None: ...


class Ended(Exception):
    """The outbox writes no more: `stalled`, the RESOURCE_EXHAUSTED that ends the stream, if it stalled;
    `lost`, if a write failed (the call is over)."""

    def __init__(self, why: str, stalled: BrokerError | None = None, lost: bool = False) -> None:
        super().__init__(why)
        self.stalled = stalled
        self.lost = lost


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    size: int


class Outbox:
    def __init__(self, write: Callable[[Message], Awaitable[None]], bounds: StreamBounds, stream: str,
                 observer: StreamObserver | None = None) -> None:
        self._write = write
        self._bounds = bounds
        self.stream = stream  # what the stream is, for messages and metrics: "Exchange", "WatchTransfer", ...
        self._observer = observer
        self._queue: deque[tuple[Message, int]] = deque()
        self._held = 0  # replies queued, being written, or given room and on their way into the queue
        self._bytes = 0
        self._waiting: deque[_Waiter] = deque()  # puts that did not fit, in their order
        self._queued = asyncio.Event()  # the writer's: the queue has a reply
        self._progress = asyncio.Event()  # the reader's and flush's: something was written, or it ended
        self.ended = asyncio.Event()
        self.end: Ended | None = None
        self._writer: asyncio.Task[None] | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._closed = False
        if observer is not None:
            observer.stream_opened(stream)

    @property
    def stalled(self) -> BrokerError | None:
        return self.end.stalled if self.end is not None else None

    @property
    def lost(self) -> bool:
        return self.end is not None and self.end.lost

    def start(self) -> None:
        self._writer = asyncio.get_running_loop().create_task(self._run(), name=f"{self.stream} writer")

    def _fits(self, size: int) -> bool:
        return self._held == 0 or (self._held < self._bounds.max_replies
                                   and self._bytes + size <= self._bounds.max_bytes)

    def below(self) -> bool:
        return self._held < self._bounds.max_replies and self._bytes < self._bounds.max_bytes

    def _hold(self, replies: int, nbytes: int) -> None:
        if self._closed:
            return
        self._held += replies
        self._bytes += nbytes
        if self._observer is not None:
            self._observer.replies_held(self.stream, replies, nbytes)

    async def put(self, reply: Message) -> None:
        """Queue `reply` once it fits; Ended if the outbox ends first."""
        if self.end is not None:
            raise self.end
        size = reply.ByteSize()
        if self._waiting or not self._fits(size):
            waiter = _Waiter(asyncio.get_running_loop().create_future(), size)
            self._waiting.append(waiter)
            try:
                await waiter.future  # resolved by _admit with its room held, or failed by _finish
            except BaseException:
                if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                    self._hold(-1, -size)  # given room, then cancelled before it took it
                    self._admit()
                elif waiter in self._waiting:
                    self._waiting.remove(waiter)
                raise
            if self.end is not None:  # given room, then the outbox ended before this put took it
                self._hold(-1, -size)
                raise self.end
        else:
            self._hold(1, size)
        self._queue.append((reply, size))
        self._queued.set()

    def _admit(self) -> None:
        """Give room to the waiting puts, in their order, while they fit."""
        while self._waiting and self._fits(self._waiting[0].size):
            waiter = self._waiting.popleft()
            if not waiter.future.done():
                self._hold(1, waiter.size)
                waiter.future.set_result(None)

    async def room(self) -> None:
        """Wait until the outbox is below its bound; Ended if it ends first."""
        while self.end is None and not self.below():
            self._progress.clear()
            await self._progress.wait()
        if self.end is not None:
            raise self.end

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout`) until every reply queued is written; True if they were."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.end is None and self._held:
                    self._progress.clear()
                    await self._progress.wait()
        return self.end is None and not self._held

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.end is None:
            while not self._queue:
                self._queued.clear()
                await self._queued.wait()
                if self.end is not None:
                    return
            reply, size = self._queue.popleft()
            self._stall = loop.call_later(self._bounds.stall_s, self._stalled)
            try:
                await self._write(reply)
            except Exception as exc:  # the call is over: the client went, or its deadline passed
                log.debug("%s stream: a reply was not written, the stream ends: %s: %s", self.stream,
                          type(exc).__name__, exc)
                self._finish(Ended(f"a reply was not written: {type(exc).__name__}", lost=True))
                return
            finally:
                self._stall.cancel()
            self._hold(-1, -size)
            self._admit()
            self._progress.set()

    def _stalled(self) -> None:
        error = BrokerError(Code.RESOURCE_EXHAUSTED,
                            f"{self.stream} stream: a reply waited more than {self._bounds.stall_s:g}s to be written "
                            f"(stream_stall_s) with {self._held} replies of {self._bytes} bytes unread "
                            f"(max_stream_replies={self._bounds.max_replies}, "
                            f"max_stream_reply_bytes={self._bounds.max_bytes}): the client does not read its replies")
        log.warning("%s", error.reason)
        if self._observer is not None:
            self._observer.stream_stalled(self.stream)
        self._finish(Ended("stalled", error))

    def _finish(self, end: Ended) -> None:
        if self.end is not None:
            return
        self.end = end
        self.ended.set()
        self._progress.set()
        for waiter in self._waiting:
            if not waiter.future.done():
                waiter.future.set_exception(end)
                waiter.future.exception()  # retrieved: a waiter cancelled meanwhile never reads it
        self._waiting.clear()
        self._queued.set()  # an idle writer sees the end and stops; one in a write stops after it

    def stop(self) -> None:
        """End the outbox: no put waits or is taken any more; the writer stops after the write it is in."""
        self._finish(Ended("closed"))

    async def settle(self, timeout: float) -> None:
        """Wait up to `timeout` for the writer to stop: the write it is in done (the client read it) or
        failed (the client went; grpc then cancels the handler, which ends as a cancellation)."""
        if self._writer is not None and not self._writer.done():
            await asyncio.wait([self._writer], timeout=timeout)

    async def close(self) -> None:
        """Stop writing; what was not written is dropped. After a stall, the write under way is given
        stream_stall_s more to be read (or the client to go) before it is cut: the status that ends the
        call follows it on the wire, and a call ended while its status waits there makes grpc log its
        client's cancel as an ERROR."""
        if self._closed:
            return
        self.stop()
        try:
            if self.stalled is not None:
                await self.settle(self._bounds.stall_s)
        finally:  # a handler cancelled meanwhile still lets go of all
            self._release()

    def _release(self) -> None:
        if self._closed:
            return
        if self._writer is not None:
            self._writer.cancel()
        self._hold(-self._held, -self._bytes)
        self._closed = True
        self._queue.clear()
        if self._observer is not None:
            self._observer.stream_closed(self.stream)


def end_stalled(context, error: BrokerError) -> None:
    """End the call with `error` once the handler returns, without waiting for the client: abort would
    wait until the status could be sent, after the replies the client does not read."""
    context.set_code(status_code(error.code))
    context.set_details(details(error.reason))


async def gone(context, timeout: float = GONE_WAIT_S) -> None:
    """After a write failed: wait (bounded) for grpc to cancel the handler, as it does for a client that
    went, so that the handler ends as a cancellation rather than returning into a call that is over."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def call_done(_: object) -> None:
        if not done.done():
            done.set_result(None)

    context.add_done_callback(call_done)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done, timeout)


async def serve(context, bounds: StreamBounds, stream: str, pump: Callable[[Outbox], Coroutine[Any, Any, None]],
                observer: StreamObserver | None = None) -> None:
    """Run `pump(outbox)` (it puts the stream's replies) until it returns and its replies are written,
    or the outbox ends: then stop the pump, and end a stalled stream RESOURCE_EXHAUSTED. An exception
    of the pump (an abort among them) is the handler's."""
    outbox = Outbox(context.write, bounds, stream, observer)
    outbox.start()
    work = asyncio.get_running_loop().create_task(pump(outbox), name=f"{stream} pump")
    ended = asyncio.ensure_future(outbox.ended.wait())
    try:
        await asyncio.wait([work, ended], return_when=asyncio.FIRST_COMPLETED)
        if work.done() and not isinstance(failure := work.exception(), Ended | None):
            raise failure
        if work.done() and outbox.end is None:
            await outbox.flush(bounds.stall_s)  # its last replies go out before the call ends
    finally:
        work.cancel()
        ended.cancel()
        try:
            await asyncio.wait([work], timeout=GONE_WAIT_S)
        finally:  # grpc may cancel the handler here too (its client went): the outbox is let go of either way
            await outbox.close()
    if outbox.stalled is not None:
        end_stalled(context, outbox.stalled)
    elif outbox.lost:
        await gone(context)

