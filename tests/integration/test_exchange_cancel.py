"""Every command on the Exchange stream can end, from either side, on real brokers (nixl; the streams
are the same code for both backends): a cancel naming a command ends it (a watch: CANCELLED, then the
cancel is answered); bad cancels (an unknown id, an ended command, a duplicate, 0, the cancel itself)
get their precise status, and a flood of them loses nothing for the other commands; a watch ends
itself at its timeout_ms; and 10 000 watch deadlines and cancels on one stream, made by the client as
a server makes them, leave the broker's command slots, tasks and memory where they were.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvbroker_client.errors import DeadlineExceeded
from kvbroker_client.exchange import Exchange
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import close_broker, open_broker
from tests.support.flows import grant, watch_first
from tests.support.streams import RawExchange, cancel, metric, ping, until_metric
from tests.support.watch import rss_mib

pytestmark = pytest.mark.integration

METRICS = ("--metrics-listen", "127.0.0.1:0")
CANCELLED = grpc.StatusCode.CANCELLED.value[0]


async def pending_grant(broker, engines, request_id: str):
    """An engine on `broker` with a claimed-flow grant that stays PENDING (nobody sends)."""
    dst = await engines.make(broker, "decode", fill="canary")
    await grant(dst, request_id, [1, 2, 3], expiry_ms=600_000)
    return dst


def watch(dst, request_id: str, **options) -> dict:
    return {"watch": bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id, **options)}


@pytest.fixture
async def broker():
    opened = await open_broker("streams", "nixl", *METRICS)
    yield opened
    await close_broker(opened)


async def test_a_cancel_ends_a_watch_then_answers_and_bad_cancels_get_their_status(broker, engines, request_id):
    dst = await pending_grant(broker, engines, request_id)
    stream = RawExchange(broker.process.listen)
    try:
        await stream.write(1, **watch(dst, request_id, states_only=True))
        assert (await stream.read()).watch.status.state == pb.TRANSFER_STATE_PENDING
        await stream.write(2, **cancel(1))
        last, answer = await stream.read(), await stream.read()
        assert (last.command_id, last.error.code) == (1, CANCELLED) and "cancelled by the client" in last.error.message
        assert (answer.command_id, answer.cancelled.command_id) == (2, 1)
        # bad cancels, each answered under its own id: an ended command, an unknown one, 0, itself
        for command_id, target in ((3, 1), (4, 99), (5, 0), (6, 6)):
            await stream.write(command_id, **cancel(target))
        replies = [await stream.read() for _ in range(4)]
        assert [(r.command_id, r.error.code) for r in replies] == [
            (3, grpc.StatusCode.NOT_FOUND.value[0]), (4, grpc.StatusCode.NOT_FOUND.value[0]),
            (5, grpc.StatusCode.INVALID_ARGUMENT.value[0]), (6, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
        assert all(r.error.message.startswith("cancel.command_id: ") for r in replies), replies
        assert "no command 1 is in flight" in replies[0].error.message
        # a duplicate cancel, sent before the first was answered: the second finds the command ended
        await stream.write(7, **watch(dst, request_id, terminal_only=True))
        await stream.write(8, **cancel(7))
        await stream.write(9, **cancel(7))
        assert await stream.read_ids(3) == [(7, "CANCELLED"), (8, "cancelled"), (9, "NOT_FOUND")]
        # the watches' cancels touched no request, and the stream goes on with every slot free
        assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING
        await stream.write(10, **ping(b"still here"))
        assert (await stream.read()).pong.payload == b"still here"
        assert await metric(broker.process.metrics_listen, "kvbroker_exchange_commands") == 0
    finally:
        await stream.close()


async def test_a_watch_ends_itself_at_its_deadline(broker, engines, request_id):
    dst = await pending_grant(broker, engines, request_id)
    stream = RawExchange(broker.process.listen)
    try:
        started = time.monotonic()
        await stream.write(1, timeout_ms=300, **watch(dst, request_id, terminal_only=True))
        reply = await stream.read()
        assert reply.command_id == 1 and reply.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], reply
        assert reply.error.message.startswith("timeout_ms: the watch's deadline of 300 ms passed")
        assert time.monotonic() - started >= 0.3
        assert await metric(broker.process.metrics_listen, "kvbroker_exchange_commands") == 0
    finally:
        await stream.close()


async def test_a_flood_of_bad_cancels_loses_nothing_for_the_other_commands(broker, engines, request_id):
    """5 000 cancels of commands that are not in flight, sent without waiting, around a watch and
    pings on the same stream: each cancel is answered NOT_FOUND, every other command as if alone."""
    dst = await pending_grant(broker, engines, request_id)
    stream = RawExchange(broker.process.listen)
    flood = 5000
    try:
        await stream.write(1, **watch(dst, request_id, states_only=True))
        assert (await stream.read()).watch.status.state == pb.TRANSFER_STATE_PENDING

        async def send() -> None:
            for n in range(flood):
                await stream.write(10 + n, **cancel(100_000 + n))
                if n % 1000 == 0:
                    await stream.write(5 + n // 1000, **ping(b"p%d" % n))

        sending = asyncio.ensure_future(send())
        replies = [await stream.read() for _ in range(flood + 5)]
        await sending
        by_kind = {}
        for reply in replies:
            by_kind.setdefault(reply.WhichOneof("reply"), []).append(reply)
        assert len(by_kind["error"]) == flood and len(by_kind["pong"]) == 5, {k: len(v) for k, v in by_kind.items()}
        assert {r.error.code for r in by_kind["error"]} == {grpc.StatusCode.NOT_FOUND.value[0]}
        assert sorted(r.pong.payload for r in by_kind["pong"]) == [b"p%d" % n for n in range(0, flood, 1000)]
        # the watch stayed in flight through it all and sees its request end
        await dst.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=dst.engine_id, request_id=request_id),
                                      timeout=30)
        last = await stream.read()
        assert last.command_id == 1 and last.watch.status.state == pb.TRANSFER_STATE_FAILED
    finally:
        await stream.close()


async def test_watch_deadlines_and_cancels_leave_slots_tasks_and_memory_at_their_baseline(broker, engines,
                                                                                      request_id):
    """10 000 watches on one stream, made by the client as a server makes them: half reach their deadline
    (the client cancels each, and the broker ends it at the same deadline), half are left by the
    caller after their first status (the client cancels each). The broker's command slots come back
    to 0, its event loop's tasks and its memory to where they were, and the stream is the first."""
    dst = await pending_grant(broker, engines, request_id)
    exchange = Exchange(broker.stub, broker.process.listen)
    metrics, pid = broker.process.metrics_listen, broker.process.pid
    rounds, width = 100, 50  # 100 rounds of 50 watches at once: 5 000 deadlines, 5 000 left

    async def deadline() -> None:
        request = bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id, terminal_only=True)
        with pytest.raises(DeadlineExceeded):
            async for _ in exchange.watch(request, 0.05):
                pass

    async def left() -> None:
        request = bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id, states_only=True)
        watching = exchange.watch(request, 60)
        assert (await anext(watching)).state == pb.TRANSFER_STATE_PENDING
        await watching.aclose()  # the caller stops iterating

    try:
        await exchange.ping(10)
        for _ in range(3):  # warm: the first rounds allocate what every later round reuses
            await asyncio.gather(*(deadline() for _ in range(width)), *(left() for _ in range(width)))
        assert await exchange.cancels_answered(30)
        assert await until_metric(metrics, "kvbroker_exchange_commands", 0)
        tasks_before, rss_before = await metric(metrics, "kvbroker_event_loop_tasks"), rss_mib(pid)
        for _ in range(rounds):
            await asyncio.gather(*(deadline() for _ in range(width)), *(left() for _ in range(width)))
        assert await exchange.cancels_answered(30)
        assert await until_metric(metrics, "kvbroker_exchange_commands", 0), "command slots still taken"
        assert exchange.cancels_sent >= rounds * width * 2
        tasks_after, rss_after = await metric(metrics, "kvbroker_event_loop_tasks"), rss_mib(pid)
        print(f"tasks {tasks_before:.0f} -> {tasks_after:.0f}, RSS {rss_before:.1f} -> {rss_after:.1f} MiB")
        assert tasks_after <= tasks_before + 5, (tasks_before, tasks_after)
        assert rss_after <= rss_before + 16, f"RSS grew from {rss_before:.1f} to {rss_after:.1f} MiB"
        assert exchange.streams_opened == 1
        assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING
    finally:
        await exchange.close()
