"""The idle policy of the peer clients: when a peer address may be forgotten. Used by PeerClients only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("kvbroker.peer")  # the logger of the peer clients, whose policy this is


class IdlePeers:
    """Idle peers: an address not used for `idle_s` (no handshake, claim or completion notice through
    it, no handshake served from the cache, no write through one of its handles) is forgotten: its
    handshakes and parked handles are given back, its channel closed, its record dropped (`forget`,
    the caller's). A replaced pod's old address is never dialed again, so nothing else would ever
    let go of it. A sweeper task, started with the first address used and ending when none is left
    (close cancels it), sleeps until the earliest address falls due; an address with a call running
    (`begin` .. `end`) or a write running (`busy`, which asks Backend.writing) is not due. A transfer
    uses its address from the handshake to the completion notice with no await in between where it
    holds none of these, so the sweeper never takes a peer from under it. On the event loop only.
    """

    def __init__(self, idle_s: float, *, busy: Callable[[str], bool], forget: Callable[[str, float], None]) -> None:
        self._idle_s = idle_s
        self._busy = busy  # whether the transfer engine writes through one of the address's handles
        self._forget = forget  # forget an idle address: (address, seconds it sat idle)
        self._used: dict[str, float] = {}  # address → loop time it was last used
        self._calls: dict[str, int] = {}  # address → calls through it now running
        self._sweeper: asyncio.Task | None = None
        self._closed = False

    def begin(self, address: str) -> None:
        """A call through `address` starts: it is in use until `end`."""
        self._calls[address] = self._calls.get(address, 0) + 1
        self._used[address] = asyncio.get_running_loop().time()
        if not self._closed and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="peer idle sweeper")
            self._sweeper.add_done_callback(_sweeper_ended)

    def end(self, address: str) -> None:
        self._used[address] = asyncio.get_running_loop().time()
        self._calls[address] -= 1
        if not self._calls[address]:
            del self._calls[address]

    async def _sweep(self) -> None:
        """Forget each address once it has been idle for idle_s; end when no address is left."""
        loop = asyncio.get_running_loop()
        while self._used:
            now = loop.time()
            due = now + self._idle_s  # an address in use is looked at again after idle_s at the latest
            for address, used in list(self._used.items()):
                if self._in_use(address):
                    continue
                if now - used >= self._idle_s:
                    self._forget(address, now - used)
                    del self._used[address]
                else:
                    due = min(due, used + self._idle_s)
            if self._used:
                await asyncio.sleep(due - now)

    def _in_use(self, address: str) -> bool:
        """A call through the address runs, or the transfer engine writes through one of its handles."""
        return address in self._calls or self._busy(address)

    async def close(self, wait_s: float) -> None:
        """Stop the sweeper (waiting up to `wait_s`) and forget every address without a word."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper], timeout=wait_s)
        self._used.clear()


def _sweeper_ended(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the peer idle sweeper failed: %r", task.exception(), exc_info=task.exception())
