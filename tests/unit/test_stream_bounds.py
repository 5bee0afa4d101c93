"""The bounds of what a stream holds for a client that does not read (edge/outbox.py), on their own,
against a servicer context whose writes the test holds:
- an Outbox holds at most its bound (replies, bytes; a bigger reply alone), gives room in order,
  and ends `stalled` (RESOURCE_EXHAUSTED naming stream_stall_s) when a write is not done in time;
- WatchTransfer and OpenSession end so, without waiting for their client, and let go of the watch
  (whose statuses stay bounded meanwhile, tests/unit/test_watch_backlog.py) and the session.
The same bounds on real brokers and real clients: tests/integration/test_streams.py."""

from __future__ import annotations

import asyncio
import types

import grpc
import numpy as np
import pytest

from kvbroker.core.model import Component
from kvbroker.edge.exchange import Exchanges
from kvbroker.edge.outbox import Ended, Outbox, StreamBounds
from kvbroker.edge.service import BrokerServicer
from kvbroker.flows.records import WATCH_BACKLOG
from kvbroker.flows.transfers import TransferTable
from kvbroker_client.v1 import broker_service_pb2 as bpb

WAIT_S = 10.0


class Context:
    """A servicer context whose writes wait until the test lets them through (`flowing`)."""

    def __init__(self) -> None:
        self.flowing = asyncio.Event()
        self.written: list = []
        self.code = self.details = None
        self.done_callbacks: list = []

    async def write(self, message) -> None:
        await self.flowing.wait()
        self.written.append(message)

    async def send_initial_metadata(self, metadata) -> None:
        pass

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def add_done_callback(self, callback) -> None:
        self.done_callbacks.append(callback)

    def time_remaining(self) -> None:
        return None  # no deadline


def pong(size: int) -> bpb.ExchangeResponse:
    return bpb.ExchangeResponse(command_id=1, pong=bpb.ExchangePing(payload=b"x" * size))


async def test_an_outbox_holds_its_bound_and_gives_room_in_order():
    context = Context()
    outbox = Outbox(context.write, StreamBounds(max_replies=3, max_bytes=1 << 20, stall_s=60), "Exchange")
    outbox.start()
    try:
        for _ in range(3):
            await outbox.put(pong(10))
        assert not outbox.below()
        room = asyncio.ensure_future(outbox.room())
        late = [asyncio.ensure_future(outbox.put(pong(n))) for n in (1, 2)]
        await asyncio.sleep(0)  # one turn: each waits (the writer is held)
        assert not room.done() and not any(p.done() for p in late)
        context.flowing.set()
        await asyncio.wait_for(asyncio.gather(room, *late), WAIT_S)
        assert await outbox.flush(WAIT_S)
        assert [len(m.pong.payload) for m in context.written] == [10, 10, 10, 1, 2]  # in their order
    finally:
        await outbox.close()


async def test_an_outbox_counts_bytes_and_takes_a_bigger_reply_alone():
    context = Context()
    outbox = Outbox(context.write, StreamBounds(max_replies=100, max_bytes=100, stall_s=60), "Exchange")
    outbox.start()
    try:
        await outbox.put(pong(500))  # bigger than the bound: goes, alone
        second = asyncio.ensure_future(outbox.put(pong(10)))
        await asyncio.sleep(0)
        assert not second.done() and not outbox.below()
        context.flowing.set()
        await asyncio.wait_for(second, WAIT_S)
        assert await outbox.flush(WAIT_S)
    finally:
        await outbox.close()


async def test_a_write_not_done_within_stream_stall_s_ends_the_outbox_and_its_waiters():
    context = Context()  # never flows: the client reads nothing
    outbox = Outbox(context.write, StreamBounds(max_replies=1, max_bytes=1 << 20, stall_s=0.2), "Exchange")
    outbox.start()
    try:
        await outbox.put(pong(1))
        waiting = asyncio.ensure_future(outbox.put(pong(1)))
        await asyncio.wait_for(outbox.ended.wait(), WAIT_S)
        with pytest.raises(Ended):
            await asyncio.wait_for(waiting, WAIT_S)
        with pytest.raises(Ended):
            await outbox.room()
        stalled = outbox.stalled
        assert stalled is not None and stalled.code.name == "RESOURCE_EXHAUSTED"
        assert "(stream_stall_s)" in stalled.reason and "max_stream_replies=1" in stalled.reason
    finally:
        await outbox.close()


def servicer(broker) -> BrokerServicer:
    bounds = StreamBounds(max_replies=2, max_bytes=1 << 20, stall_s=0.2)
    return BrokerServicer(broker, 1.0, exchanges=Exchanges(broker, 8, 1.0, bounds))


async def test_a_watch_transfer_nobody_reads_ends_resource_exhausted_and_lets_go_of_the_watch():
    table = TransferTable()
    record = table.add_grant("decode-0", "r1", {Component.MAIN_KV: np.arange(4, dtype=np.int64)}, 60.0, None)

    async def watch(engine_id, request_id, **options):
        return table.watch(engine_id, request_id)

    broker = types.SimpleNamespace(watch=watch, stopping=asyncio.Event(), limits=types.SimpleNamespace(
        peer_settle_s=1.0))
    context = Context()
    request = bpb.WatchTransferRequest(engine_id="decode-0", request_id="r1")
    handler = asyncio.ensure_future(servicer(broker).WatchTransfer(request, context))
    try:
        for part in range(200):  # more changes than the watch and the stream hold: folded, then stalled
            table.progress(record, landed={Component.MAIN_KV: 1}, runs=1, nbytes=64)
            await asyncio.sleep(0)
            assert sum(len(w) for w in record.watchers) <= WATCH_BACKLOG + 2, part
        await asyncio.wait_for(handler, WAIT_S)  # ended, without the client reading anything
        assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "(stream_stall_s)" in context.details
        assert not record.watchers  # the watch let go of the record
    finally:
        handler.cancel()


async def test_an_open_session_whose_id_is_never_read_ends_and_the_session_with_it():
    ended = []
    broker = types.SimpleNamespace(
        open_session=lambda holder: types.SimpleNamespace(session_id="s-1"),
        end_session=lambda session_id, wait_s: ended.append(session_id), stopping=asyncio.Event(),
        limits=types.SimpleNamespace(peer_settle_s=1.0))
    context = Context()
    await asyncio.wait_for(servicer(broker).OpenSession(bpb.OpenSessionRequest(holder="h"), context), WAIT_S)
    assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "OpenSession stream" in context.details
    assert ended == ["s-1"]
