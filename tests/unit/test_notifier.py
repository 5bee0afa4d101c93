"""The Notifier: a notice goes out at once while the peer's window has room, and queued notices
share the next call; every caller gets its own ack or the call's failure."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.core.errors import BrokerError, Code
from kvbroker.peers.notifier import Notifier


class Peer:
    """A fake NotifyParts endpoint whose calls wait until the test releases them."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail: BrokerError | None = None
        self.called = asyncio.Event()
        self._changed = asyncio.Condition()

    async def calls_reach(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.batches) >= n)

    async def send(self, address, notices, timeout):
        self.batches.append(list(notices))
        self.called.set()
        async with self._changed:
            self._changed.notify_all()
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return [f"ack {n}" for n in notices]


async def test_queued_notices_share_the_next_call_and_each_gets_its_ack():
    peer = Peer()
    notifier = Notifier(peer.send, timeout_s=5, window=1)
    first = asyncio.create_task(notifier.notify("p:1", "n0"))
    await asyncio.wait_for(peer.called.wait(), 5)
    rest = [asyncio.create_task(notifier.notify("p:1", f"n{i}")) for i in range(1, 6)]
    await asyncio.sleep(0)  # let them queue behind the call in flight
    peer.release.set()
    acks = await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    assert acks == [f"ack n{i}" for i in range(6)]
    assert peer.batches == [["n0"], ["n1", "n2", "n3", "n4", "n5"]]
    assert notifier.calls == 2 and notifier.notices == 6


async def test_notices_to_different_peers_do_not_wait_for_each_other():
    peer = Peer()
    notifier = Notifier(peer.send, timeout_s=5, window=1)
    calls = [asyncio.create_task(notifier.notify(f"p:{i}", "n")) for i in range(3)]
    await asyncio.wait_for(peer.calls_reach(3), 5)  # all three in flight before any was answered
    peer.release.set()
    await asyncio.wait_for(asyncio.gather(*calls), 5)


async def test_a_failed_call_fails_every_notice_it_carried():
    peer = Peer()
    peer.fail = BrokerError(Code.UNAVAILABLE, "peer broker p:1: no answer")
    peer.release.set()
    notifier = Notifier(peer.send, timeout_s=5, window=2)
    results = await asyncio.gather(*(notifier.notify("p:1", f"n{i}") for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, BrokerError) and r.code is Code.UNAVAILABLE for r in results)


async def test_close_fails_what_is_in_flight():
    peer = Peer()
    notifier = Notifier(peer.send, timeout_s=5, window=1)
    waiting = asyncio.create_task(notifier.notify("p:1", "n0"))
    await asyncio.wait_for(peer.called.wait(), 5)
    await notifier.close()
    with pytest.raises(BrokerError) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.code is Code.UNAVAILABLE
    with pytest.raises(BrokerError):
        await notifier.notify("p:1", "late")


async def test_a_call_carries_no_more_aux_than_its_byte_bound():
    """Notices with big aux payloads are spread over calls so none outgrows the peer port's limit."""
    from dataclasses import dataclass

    @dataclass
    class Notice:
        name: str
        aux: bytes

    peer = Peer()
    notifier = Notifier(peer.send, timeout_s=5, window=1, max_batch_bytes=3 * 1024)
    first = asyncio.create_task(notifier.notify("p:1", Notice("n0", b"")))
    await asyncio.wait_for(peer.called.wait(), 5)
    rest = [asyncio.create_task(notifier.notify("p:1", Notice(f"n{i}", b"x" * 1000))) for i in range(1, 7)]
    await asyncio.sleep(0)
    peer.release.set()
    await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    sizes = [len(batch) for batch in peer.batches]
    assert sizes[0] == 1 and sum(sizes) == 7 and max(sizes[1:]) == 2  # 2 x (1000 + 256) fit, 3 do not
