"""The peer port's shares, per peer host and in all, decided before a request is read (Admission):

- `peer_host`: what calls from one peer host have in common (its address without the port);
- `PeerReads`: requests received and parsed at once, in all and per host, each waiting its turn unread;
- `StreamQuota`: notice streams open at once, in all and per host, refused as they open.
"""

from __future__ import annotations

import asyncio

import grpc


def peer_host(peer: str) -> str:
    """"ipv4:10.0.0.7:41234" → "ipv4:10.0.0.7": what calls from one peer have in common."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class SlotTimeout(Exception):
    """No read slot came free within PeerReads.wait_s."""


class PeerReads:
    """The peer port's reads: at most `reads` requests received and parsed at once, at most `per_host`
    of them for one peer host, so that no host holds them all. A call waits for its turn with its
    request unread, up to `wait_s`; the read itself has `wait_s` too."""

    def __init__(self, reads: int, per_host: int, wait_s: float) -> None:
        self.reads = reads
        self.per_host = per_host
        self.wait_s = wait_s
        self._all = asyncio.Semaphore(reads)
        self._hosts: dict[str, list] = {}  # host -> [its semaphore, calls holding or waiting for it]

    def waiting(self, host: str) -> int:
        entry = self._hosts.get(host)
        return entry[1] if entry is not None else 0

    async def read(self, context: grpc.aio.ServicerContext, host: str):
        """The call's next request, read in turn. SlotTimeout when no turn came within wait_s,
        TimeoutError when the request did not arrive within wait_s of its turn."""
        entry = self._hosts.setdefault(host, [asyncio.Semaphore(self.per_host), 0])
        entry[1] += 1
        try:
            try:
                async with asyncio.timeout(self.wait_s):
                    await entry[0].acquire()
                    try:
                        await self._all.acquire()
                    except BaseException:
                        entry[0].release()
                        raise
            except TimeoutError:
                raise SlotTimeout from None
            try:
                async with asyncio.timeout(self.wait_s):
                    return await context.read()
            finally:
                self._all.release()
                entry[0].release()
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._hosts[host]


class StreamQuota:
    """The notice streams the peer port holds at once: at most `total`, at most `per_host` of one peer
    host. One more is refused as it opens, before any of its messages is read."""

    def __init__(self, total: int, per_host: int) -> None:
        self.total = total
        self.per_host = per_host
        self._hosts: dict[str, int] = {}
        self._open = 0

    def enter(self, host: str) -> str | None:
        """Count one more stream of `host`; or why not, naming the setting."""
        if self._open >= self.total:
            return f"{self._open} notice streams are open, the most this broker holds (max_peer_notice_streams)"
        if self._hosts.get(host, 0) >= self.per_host:
            return (f"{host} holds {self.per_host} notice streams, the most one peer host may "
                    "(max_notice_streams_per_peer)")
        self._open += 1
        self._hosts[host] = self._hosts.get(host, 0) + 1
        return None

    def leave(self, host: str) -> None:
        self._open -= 1
        self._hosts[host] -= 1
        if not self._hosts[host]:
            del self._hosts[host]


