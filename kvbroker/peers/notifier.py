"""Part notices to receiving brokers, batched per peer: the one peer message on a part's critical path.

A part's notice goes out at once when fewer than `window` NotifyParts calls to its peer are in
flight; otherwise it waits in the peer's queue, and the next call carries every notice queued by
then, up to `max_batch` notices and `max_batch_bytes` of them (so that no call outgrows the peer
port's message limit, however much aux its notices carry). Under light load each notice is its own
call; under heavy load one call carries many, so the calls per second to a peer stay bounded while
no notice waits for a timer. Each notice's caller gets its own ack, or the call's failure. Used by
the sender pipeline.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.tasks import OwnedTasks

log = logging.getLogger(__name__)

WINDOW = 4  # NotifyParts calls in flight per peer
MAX_BATCH = 1024  # notices per call (the peer API's bound)
NOTICE_OVERHEAD = 256  # bytes a notice takes on the wire besides its aux payload, at most (ids, token, landed)

N = TypeVar("N")  # a notice
A = TypeVar("A")  # its ack
# rpc(address, notices, timeout) -> one ack per notice, in order
SendNotices = Callable[[str, Sequence[N], float], Awaitable[Sequence[A]]]


@dataclass
class _Peer(Generic[N, A]):
    queue: deque[tuple[N, asyncio.Future[A]]] = field(default_factory=deque)
    in_flight: int = 0


class Notifier(Generic[N, A]):
    def __init__(self, send: SendNotices[N, A], *, timeout_s: float, window: int = WINDOW,
                 max_batch: int = MAX_BATCH, max_batch_bytes: int = 1 << 62) -> None:
        self._send = send
        self._max_batch_bytes = max_batch_bytes
        self._timeout_s = timeout_s
        self._window = window
        self._max_batch = max_batch
        self._peers: dict[str, _Peer[N, A]] = {}
        self._tasks = OwnedTasks()
        self._closed = False
        self.calls = 0  # NotifyParts calls made, for tests and the benchmark
        self.notices = 0

    async def notify(self, address: str, notice: N) -> A:
        """Send one notice to the broker at `address`; returns its ack. Raises the call's BrokerError."""
        if self._closed:
            raise BrokerError(Code.UNAVAILABLE, "broker is shutting down")
        peer: _Peer[N, A] = self._peers.setdefault(address, _Peer())
        future: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)  # a caller that went away leaves no unretrieved error
        peer.queue.append((notice, future))
        if peer.in_flight < self._window:
            self._start(address, peer)
        return await asyncio.shield(future)  # the notice is sent whatever becomes of this caller

    def _start(self, address: str, peer: _Peer[N, A]) -> None:
        peer.in_flight += 1
        self._tasks.spawn(self._drain(address, peer), f"notify {address}")

    async def _drain(self, address: str, peer: _Peer[N, A]) -> None:
        try:
            while peer.queue:
                await self._call(address, self._take_batch(peer))
        finally:
            peer.in_flight -= 1
            if not peer.in_flight and not peer.queue and self._peers.get(address) is peer:
                del self._peers[address]

    def _take_batch(self, peer: _Peer[N, A]) -> list[tuple[N, asyncio.Future[A]]]:
        """The next call's notices: at least one, then as many as fit both bounds."""
        batch = [peer.queue.popleft()]
        size = _size(batch[0][0])
        while peer.queue and len(batch) < self._max_batch:
            more = _size(peer.queue[0][0])
            if size + more > self._max_batch_bytes:
                break
            batch.append(peer.queue.popleft())
            size += more
        return batch

    async def _call(self, address: str, batch: list[tuple[N, asyncio.Future[A]]]) -> None:
        self.calls += 1
        self.notices += len(batch)
        try:
            acks = await self._send(address, [notice for notice, _ in batch], self._timeout_s)
            if len(acks) != len(batch):
                raise BrokerError(Code.ABORTED, f"peer broker {address}: answered {len(acks)} acks to "
                                                f"{len(batch)} notices")
        except asyncio.CancelledError:
            error = BrokerError(Code.UNAVAILABLE, "broker is shutting down")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            raise
        except BrokerError as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except Exception as exc:  # a bug must fail the notices, not leave their parts waiting
            log.exception("notifying %s failed", address)
            for _, future in batch:
                if not future.done():
                    future.set_exception(BrokerError(Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"))
            return
        for (_, future), ack in zip(batch, acks):
            if not future.done():
                future.set_result(ack)

    async def close(self) -> None:
        self._closed = True
        await self._tasks.cancel(5)


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _size(notice: object) -> int:
    return NOTICE_OVERHEAD + len(getattr(notice, "aux", b"") or b"")
