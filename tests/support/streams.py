"""What the stream tests share (test_stream_backpressure.py, test_exchange_cancel.py): a raw Exchange stream
whose every reply the test sees (`RawExchange`), a client that writes and never reads until the
broker stops reading it (`writes_until_blocked`), and a broker's metric samples by label
(`samples`, `metric`, `until_metric`). Not a test module: test modules import from here, never from each other."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

# A client whose transport keeps its receive window at HTTP/2's initial 64 KiB (no BDP probing): the
# broker's writes block after that much unread, so that a test reaches the broker's bound quickly.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]
READ_TIMEOUT_S = 30.0
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class RawExchange:
    """One Exchange stream on a channel of its own: the test writes commands and reads every reply."""

    def __init__(self, address: str, options=()) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=list(options))
        self.call = bpb_grpc.BrokerServiceStub(self.channel).Exchange()

    async def write(self, command_id: int, **command) -> None:
        await self.call.write(bpb.ExchangeRequest(command_id=command_id, **command))

    async def read(self, timeout: float = READ_TIMEOUT_S) -> bpb.ExchangeResponse:
        reply = await asyncio.wait_for(self.call.read(), timeout)
        assert reply is not grpc.aio.EOF, "the broker ended the stream"
        return reply

    async def read_ids(self, count: int) -> list[tuple[int, str]]:
        """The next `count` replies as (command_id, kind), kind the reply's field or the error's code name."""
        seen = []
        for _ in range(count):
            reply = await self.read()
            kind = reply.WhichOneof("reply")
            seen.append((reply.command_id, CODE_NAMES[reply.error.code] if kind == "error" else kind))
        return seen

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def ping(payload: bytes = b"") -> dict:
    return {"ping": bpb.ExchangePing(payload=payload)}


def cancel(target: int) -> dict:
    return {"cancel": bpb.ExchangeCancel(command_id=target)}


class Blocked:
    """How many writes returned before the writer was blocked, with the one left hanging."""

    def __init__(self) -> None:
        self.written = 0


@contextlib.asynccontextmanager
async def writes_until_blocked(write: Callable[[int], Awaitable[object]], most: int,
                               quiet_s: float = 2.0) -> AsyncIterator[Blocked]:
    """Call `await write(n)` for n = 1, 2, ... until one has not returned for `quiet_s` (the broker
    stopped reading, and the transport's windows are full) or `most` were written. The write left
    hanging stays so while the block runs (cancelling it would cancel its gRPC call), and is
    cancelled after it."""
    blocked = Blocked()

    async def writing() -> None:
        while blocked.written < most:
            await write(blocked.written + 1)
            blocked.written += 1

    task = asyncio.ensure_future(writing())
    try:
        while not task.done():
            before = blocked.written
            await asyncio.wait([task], timeout=quiet_s)
            if blocked.written == before:
                break  # nothing written for quiet_s: blocked
        yield blocked
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def samples(metrics_listen: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of metric `name` at a broker's /metrics, by their labels (sorted pairs)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_listen}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


async def metric(metrics_listen: str, name: str, **labels: str) -> float:
    """One sample of metric `name` (the one with these labels), read off the event loop."""
    found = await asyncio.to_thread(samples, metrics_listen, name)
    return found[tuple(sorted(labels.items()))]


async def until_metric(metrics_listen: str, name: str, value: float, timeout: float = 30.0, **labels) -> bool:
    """Poll a broker's metric until it reads `value` (bounded); whether it did."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if await metric(metrics_listen, name, **labels) == value:
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
