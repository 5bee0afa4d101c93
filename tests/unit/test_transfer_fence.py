"""An offered grant that fails without its sender ends only once its fence (the revocation) is done.

The TransferTable on its own, with a fence the test holds open: until the fence returns, the grant
is ending (its outcome decided, its watchers and status still live, no part and no other end taken);
then it ends FAILED with the first cause, plus the fence's note when the sender's word is missing.
"""

from __future__ import annotations

import asyncio

import numpy as np

from kvbroker.core.errors import Code
from kvbroker.core.model import Component, TransferState
from kvbroker.core.parts import Landing
from kvbroker.flows.records import OfferedGrant
from kvbroker.flows.transfers import TransferTable

MAIN_KV = Component.MAIN_KV
WAIT_S = 5.0


class Fence:
    """A fence the test opens: records what it was asked to fence, answers `note` when let go."""

    def __init__(self, note: str = "") -> None:
        self.asked: list[str] = []
        self.called = asyncio.Event()
        self.open = asyncio.Event()
        self.note = note

    async def __call__(self, record) -> str:
        self.asked.append(record.request_id)
        self.called.set()
        await asyncio.wait_for(self.open.wait(), WAIT_S)
        return self.note


def offered_grant(table: TransferTable, request_id: str = "r1", expiry_s: float = 60.0):
    granted = {MAIN_KV: np.arange(4, dtype=np.int64)}
    offered = OfferedGrant("127.0.0.1:1", "", "token", Landing(granted, 8))
    offered.offered.set()
    return table.add_grant("decode-0", request_id, granted, expiry_s, offered)


async def next_state(watch) -> TransferState:
    return (await asyncio.wait_for(anext(watch), WAIT_S)).state


async def test_a_cancelled_offered_grant_stays_live_to_its_watchers_until_the_fence_is_done():
    fence = Fence()
    table = TransferTable(fence=fence)
    record = offered_grant(table)
    watch = table.watch("decode-0", "r1")
    assert await next_state(watch) is TransferState.PENDING

    assert table.fail(record, Code.CANCELLED, "cancelled: by the caller")
    await asyncio.wait_for(fence.called.wait(), WAIT_S)
    assert record.settled and not record.state.terminal and not record.done.is_set()
    assert table.get("decode-0", "r1").snapshot().state is TransferState.PENDING
    # ending: no part lands, no other end is taken
    table.progress(record, landed={MAIN_KV: 1}, runs=1, nbytes=64)
    assert record.pages == 0
    assert not table.succeed(record)
    assert not table.fail(record, Code.ABORTED, "another cause")

    fence.open.set()
    assert await next_state(watch) is TransferState.FAILED
    assert (record.code, record.reason) == (int(Code.CANCELLED), "cancelled: by the caller")
    assert fence.asked == ["r1"]


async def test_an_expired_offered_grant_fails_after_the_fence_with_its_note():
    fence = Fence(note="its revocation at the sender 127.0.0.1:1 failed: no answer within 5s")
    table = TransferTable(fence=fence)
    record = offered_grant(table, expiry_s=0.01)
    await asyncio.wait_for(fence.called.wait(), WAIT_S)  # the expiry timer fired
    assert not record.state.terminal
    fence.open.set()
    await table.ended([record], timeout=WAIT_S)
    assert record.state is TransferState.FAILED and record.code == int(Code.DEADLINE_EXCEEDED)
    assert record.reason.startswith("grant expired")
    assert record.reason.endswith("(its revocation at the sender 127.0.0.1:1 failed: no answer within 5s)")


async def test_a_grant_whose_sender_reported_the_failure_ends_at_once():
    fence = Fence()
    table = TransferTable(fence=fence)
    record = offered_grant(table)
    record.offered.sender_failed = True
    assert table.fail(record, Code.ABORTED, "sender 'p' failed: boom")
    assert record.state is TransferState.FAILED and fence.asked == []


async def test_close_ends_every_ending_grant_even_if_its_fence_hangs():
    fence = Fence()
    table = TransferTable(fence=fence)
    records = [offered_grant(table, f"r{i}") for i in range(3)]
    for record in records:
        table.fail(record, Code.UNAVAILABLE, "broker shut down before the request completed")
    await table.close(timeout=0.05)
    assert [r.state for r in records] == [TransferState.FAILED] * 3
    assert all(r.done.is_set() for r in records)

