"""The Exchange stream's handler against a servicer context that keeps grpc.aio's rules: no reply is
written before the stream's initial metadata has been sent, and a reply that cannot be written ends
the stream instead of leaving its client to wait out the command's deadline.

The real stream, on real brokers, is tests/integration/test_exchange.py; these pin an ordering that a
loaded machine shows only rarely there (about one stream in thousands)."""

from __future__ import annotations

import asyncio
import logging
import types

from kvbroker.edge.exchange import Exchanges
from kvbroker_client.v1 import broker_service_pb2 as bpb

END = object()


class Context:
    """grpc.aio's server context, as far as the stream uses it. grpc marks the initial metadata sent
    only once its send completes, which a busy loop runs after other ready callbacks (modelled as
    `lag` turns of the loop); a write before then sends the metadata again, which grpc core refuses
    (ExecuteBatchError: too many operations)."""

    def __init__(self, lag: int = 20) -> None:
        self.lag = lag
        self.metadata_sent = False
        self.refuse_writes = False
        self.replies: list[bpb.ExchangeResponse] = []
        self.written = asyncio.Event()
        self.code = self.details = None
        self.callbacks = []

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)  # grpc calls them when the call ends; here it never does

    async def send_initial_metadata(self, metadata) -> None:
        for _ in range(self.lag):
            await asyncio.sleep(0)  # one turn of the loop each: what else is ready runs first
        self.metadata_sent = True

    async def write(self, reply: bpb.ExchangeResponse) -> None:
        if not self.metadata_sent:
            raise RuntimeError("initial metadata sent twice: the batch is refused (too many operations)")
        if self.refuse_writes:
            raise RuntimeError("the write failed")
        self.replies.append(reply)
        self.written.set()

    def done(self) -> bool:
        return False


async def messages(queue: asyncio.Queue):
    while (message := await queue.get()) is not END:
        yield message


def ping(command_id: int) -> bpb.ExchangeRequest:
    return bpb.ExchangeRequest(command_id=command_id, ping=bpb.ExchangePing(payload=b"hello"))


async def test_the_first_command_is_answered_after_the_initial_metadata_not_lost_before_it():
    broker = types.SimpleNamespace(stopping=asyncio.Event())
    exchanges, context, client = Exchanges(broker, 8, 1.0), Context(), asyncio.Queue()
    client.put_nowait(ping(1))  # the client's first command, there as soon as the stream reads
    serving = asyncio.ensure_future(exchanges.serve(messages(client), context))
    try:
        async with asyncio.timeout(10):
            await context.written.wait()
        assert [(r.command_id, r.pong.payload) for r in context.replies] == [(1, b"hello")]
        client.put_nowait(END)  # the client half-closes: the stream ends
        async with asyncio.timeout(10):
            await serving
    finally:
        serving.cancel()
        await exchanges.close()


async def test_a_reply_that_cannot_be_written_ends_the_stream(caplog):
    broker = types.SimpleNamespace(stopping=asyncio.Event())
    exchanges, context, client = Exchanges(broker, 8, 1.0), Context(lag=0), asyncio.Queue()
    context.refuse_writes = True
    client.put_nowait(ping(7))  # and the client stays, waiting for its answer
    serving = asyncio.ensure_future(exchanges.serve(messages(client), context))
    try:
        with caplog.at_level(logging.DEBUG, logger="kvbroker.edge.outbox"):
            async with asyncio.timeout(10):
                await serving  # ended: the client's reader sees the stream end, not a silent one
        assert context.replies == []
        lines = [r for r in caplog.records if "a reply was not written, the stream ends" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.DEBUG]  # the client went: not the broker's error
    finally:
        serving.cancel()
        await exchanges.close()
