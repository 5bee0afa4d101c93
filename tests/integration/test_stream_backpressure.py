"""Write-side backpressure on every stream the broker writes, on real brokers (nixl; the streams are
the same code for both backends): a client that never reads its replies is held to
max_stream_replies and max_stream_reply_bytes. The broker stops reading its commands (its writes
block), its memory stays bounded, and another client's pings keep their latency; after the client
cancels, what its stream held is gone. One stuck past stream_stall_s is ended RESOURCE_EXHAUSTED
naming the setting, and the request its stream carried fails as at any stream's end. The peer
NotifyStream too, with its stream slot freed, and a cancelled stuck stream logs no ERROR line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import pytest

from kvbroker.edge.exchange import END_REASON
from kvbroker_client.exchange import Exchange
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from tests.support.brokers import close_broker, open_broker
from tests.support.flows import MAIN, watch_all
from tests.support.helpers import until
from tests.support.streams import SMALL_WINDOW, RawExchange, metric, ping, until_metric, writes_until_blocked
from tests.support.watch import prompt_bound, rss_mib

pytestmark = pytest.mark.integration

METRICS = ("--metrics-listen", "127.0.0.1:0")
# Commands of a client that stops reading, each about 20 bytes and answered with about 80 (a refusal):
# fewer than 1 000 answers fill its 64 KiB window, and the rest of them fit in the broker's.
STUCK_COMMANDS = 2000
STUCK_NOTICES = 2000
NO_ENGINE = bpb.ExpectTransferRequest(engine_id="e", request_id="r")  # NOT_FOUND
CANCELLED = grpc.StatusCode.CANCELLED.value[0]


async def paced(stop: asyncio.Event, seconds: float) -> None:
    """The pace of a sampling loop: `seconds`, or less once `stop` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def pings_timed(exchange: Exchange, stop: asyncio.Event, times: list[float]) -> None:
    """Ping on `exchange` every 20 ms until `stop`, each ping's time appended to `times`."""
    while not stop.is_set():
        started = time.monotonic()
        await exchange.ping(30)
        times.append(time.monotonic() - started)
        await paced(stop, 0.02)


async def test_a_client_that_never_reads_is_bounded_and_others_keep_their_latency(engines, request_id):
    """A client writes 64-byte pings and never reads. The broker holds at most max_stream_replies of
    their pongs, then reads no more of its pings: the client's writes block after a bounded number.
    Meanwhile another client's pings answer within a few times their calm latency, and the broker's
    RSS stays within 64 MiB of its baseline, peak included; after the client cancels, its stream and
    replies are gone and RSS settles back."""
    broker = await open_broker("streams-stuck", "nixl", *METRICS, "--max-stream-replies", "64",
                               "--max-stream-reply-bytes", "65536", "--stream-stall-s", "600")
    metrics, pid = broker.process.metrics_listen, broker.process.pid
    other = Exchange(broker.stub, broker.process.listen)
    stuck = RawExchange(broker.process.listen)  # default channel options: BDP probing grows its windows
    try:
        calm = []
        for _ in range(50):
            started = time.monotonic()
            await other.ping(30)
            calm.append(time.monotonic() - started)
        rss_before, peak = rss_mib(pid), 0.0
        stop, during = asyncio.Event(), []
        timing = asyncio.ensure_future(pings_timed(other, stop, during))

        async def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, rss_mib(pid))
                await paced(stop, 0.05)

        sampling = asyncio.ensure_future(sample())
        most = 400_000  # far past what the windows hold (about 110 k here); a broker without the bound took 260 k
        # pings for +707 MB
        async with writes_until_blocked(lambda n: stuck.write(n, **ping(b"x" * 64)), most) as blocked:
            assert blocked.written < most, "the broker read every ping of a client that reads nothing"
            held = await metric(metrics, "kvbroker_stream_replies_held", stream="Exchange")
            held_bytes = await metric(metrics, "kvbroker_stream_reply_bytes_held", stream="Exchange")
            pinged, written_then = len(during), blocked.written
            assert await until(lambda: len(during) >= pinged + 100, 120)  # the stall goes on meanwhile
            assert blocked.written == written_then, "the broker read the stuck client's pings again"
            stop.set()
            await asyncio.gather(timing, sampling)
            await stuck.close()  # the client cancels, its write still blocked
        stalled = during[pinged:]  # while the stuck client's writes were blocked
        print(f"{blocked.written} pings written before the broker stopped reading; {held:.0f} pongs ({held_bytes:.0f} "
              f"bytes) held; RSS {rss_before:.1f} MiB, peak {peak:.1f}; other's pings: calm max "
              f"{max(calm) * 1e3:.1f} ms, during the flood and the stall max {max(during) * 1e3:.1f} ms over "
              f"{len(during)}, during the stall max {max(stalled) * 1e3:.1f} ms over {len(stalled)}")
        assert held <= 64 and held_bytes <= 65536, (held, held_bytes)
        assert peak - rss_before <= 64, f"RSS rose from {rss_before:.1f} to {peak:.1f} MiB"
        # generous bounds, for a machine shared with other suites: the flood's writes run in this process too
        assert max(during) <= prompt_bound(calm, floor=5.0), (max(calm), max(during))
        assert len(stalled) >= 100 and max(stalled) <= prompt_bound(calm), (max(calm), max(stalled))
        assert await until_metric(metrics, "kvbroker_streams_open", 1, stream="Exchange")  # the other's alone
        assert await until_metric(metrics, "kvbroker_stream_replies_held", 0, stream="Exchange")
        assert await until_metric(metrics, "kvbroker_exchange_commands", 0)
        assert await until(lambda: rss_mib(pid) <= rss_before + 32, 30), (rss_before, rss_mib(pid))
        await other.ping(10)
    finally:
        await other.close()
        await stuck.close()
        await close_broker(broker)


async def test_a_client_stuck_past_stream_stall_s_is_ended_and_what_it_carried_freed(engines, request_id):
    broker = await open_broker("streams-stall", "nixl", *METRICS, "--max-stream-replies", "16",
                               "--stream-stall-s", "1")
    metrics = broker.process.metrics_listen
    stuck = RawExchange(broker.process.listen, SMALL_WINDOW)
    try:
        dst = await engines.make(broker, "decode", fill="canary")
        await stuck.write(1, expect=bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id,
                                                               components=[MAIN], dst_page_ids=[1, 2],
                                                               expiry_ms=600_000))
        assert (await stuck.read()).expect.status.state == pb.TRANSFER_STATE_PENDING  # carried by the stream
        # More small commands than their longer answers fill the client's 64 KiB window with (about 800)
        # and the stream's bound, and few enough that the rest wait in the broker's receive window:
        # every write returns, so that the client sees the broker's status (a write grpc fails under
        # it reads as INTERNAL).
        for n in range(STUCK_COMMANDS):
            await asyncio.wait_for(stuck.write(n + 2, expect=NO_ENGINE), 30)
        assert await until_metric(metrics, "kvbroker_streams_stalled_total", 1, stream="Exchange")
        final = (await watch_all(dst, request_id))[-1]  # the grant the stream carried is freed
        assert (final.state, final.code) == (pb.TRANSFER_STATE_FAILED, CANCELLED) and END_REASON in final.reason
        answered = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:  # the client reads at last: its answers, then the end
            while (reply := await asyncio.wait_for(stuck.call.read(), 30)) is not grpc.aio.EOF:
                answered += reply.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ended.value
        assert "(stream_stall_s)" in ended.value.details() and "max_stream_replies=16" in ended.value.details()
        assert 0 < answered < STUCK_COMMANDS  # the broker stopped reading its commands
        assert await until_metric(metrics, "kvbroker_streams_open", 0, stream="Exchange")
        assert await until_metric(metrics, "kvbroker_exchange_commands", 0)
    finally:
        await stuck.close()
        await close_broker(broker)


def error_lines(broker) -> list[str]:
    """The broker's log lines at ERROR or above (it logs JSON: its stderr is a pipe)."""
    lines = []
    for line in broker.process.stderr_lines:
        try:
            level = json.loads(line).get("level")
        except ValueError:
            continue
        if level in ("error", "critical"):
            lines.append(line)
    return lines


def notices(seq: int) -> ppb.NotifyStreamRequest:
    """An offer for an engine the broker does not have: a short request, a longer answer (NOT_FOUND)."""
    return ppb.NotifyStreamRequest(seq=seq, offer=ppb.OfferGrantRequest(broker_id="stranger", sender_engine_id="e"))


async def test_a_peer_that_never_reads_its_notify_stream_is_ended_and_its_slot_freed():
    """NotifyStream, a stranger's: it sends and never reads. The broker stops reading it, ends it
    RESOURCE_EXHAUSTED after stream_stall_s, and its stream slot (one per host here) serves the next
    stream; a stuck stream its client cancels logs no ERROR line, only debug ones."""
    # stream_stall_s long enough that the second stream is still stuck, not ended yet, when its client cancels
    broker = await open_broker("streams-notify", "nixl", *METRICS, "--max-stream-replies", "8", "--stream-stall-s",
                               "6", "--max-notice-streams-per-peer", "1", "--log-level", "DEBUG")
    metrics = broker.process.metrics_listen
    channel = grpc.aio.insecure_channel(broker.peer_address, options=SMALL_WINDOW)
    peer = ppb_grpc.PeerServiceStub(channel)
    try:
        stream = peer.NotifyStream()
        await stream.write(notices(1))
        assert (await stream.read()).seq == 1
        for n in range(STUCK_NOTICES):  # as the Exchange test's commands: more than are answered, all written
            await asyncio.wait_for(stream.write(notices(n + 2)), 30)
        assert await until_metric(metrics, "kvbroker_streams_stalled_total", 1, stream="NotifyStream")
        answered = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while await asyncio.wait_for(stream.read(), 30) is not grpc.aio.EOF:
                answered += 1
        assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "(stream_stall_s)" in ended.value.details()
        assert 0 < answered < STUCK_NOTICES
        # its slot is free: the next stream of this host is served; this one the client cancels while stuck
        again = peer.NotifyStream()
        await again.write(notices(1))
        assert (await again.read()).seq == 1
        for n in range(STUCK_NOTICES):
            await asyncio.wait_for(again.write(notices(n + 2)), 30)
        assert await until_metric(metrics, "kvbroker_stream_replies_held", 8, stream="NotifyStream")  # stuck
        again.cancel()
        assert await metric(metrics, "kvbroker_streams_stalled_total", stream="NotifyStream") == 1
        assert await until_metric(metrics, "kvbroker_streams_open", 0, stream="NotifyStream")
        assert error_lines(broker) == []
        assert any("RPC cancelled" in line or "reply was not written" in line for line in broker.process.stderr_lines)
    finally:
        await channel.close()
        await close_broker(broker)
