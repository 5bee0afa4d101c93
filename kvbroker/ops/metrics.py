"""Prometheus metrics of one broker: its own registry, fed by three hooks, served over HTTP.

`Metrics` is built by BrokerServer and handed down. The Registry tells it of engines added and
removed, the TransferTable of every record's state change, PeerClients of every handshake and every
NotifyParts call (with how many part notices it carries); all three call on the event loop.
`serve` starts the HTTP endpoint on a daemon thread, which reads the (thread-safe) metric values
when scraped; `close` stops it. Every metric is listed in the README.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from kvbroker.core.errors import code_name
from kvbroker.core.model import Component, TransferState
from kvbroker.flows.registry import Engine
from kvbroker.flows.transfers import TransferRecord

# Why Admission refuses a request, per port (edge/admission.py): too_large by its size before it is
# parsed, malformed when it does not parse, too_many_entries by a list over its bound; on the peer
# port also no_read_slot when its reads stayed taken for peer_rpc_timeout_s, and no_message for a call
# that carried none (grpc refused its message over max_peer_message_bytes, or the caller sent none),
# and notice_streams for a NotifyStream beyond max_peer_notice_streams or max_notice_streams_per_peer.
REFUSAL_REASONS = {"local": ("too_large", "malformed", "too_many_entries"),
                   "peer": ("too_large", "malformed", "too_many_entries", "no_read_slot", "no_message",
                            "notice_streams")}

STREAMS = ("Exchange", "WatchTransfer", "OpenSession", "NotifyStream")  # the streams the broker writes (edge/outbox.py)

# From one small page on loopback (well under a millisecond) to the default transfer timeout.
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def split_address(address: str) -> tuple[str, int]:
    """host:port or [v6]:port → (host, port); the host must be given, port 0 picks a free port."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics_listen: {address!r} is not host:port")
    return host, int(port)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.transfers_started = Counter(
            "kvbroker_transfers_started", "Requests accepted (grants and Transfer calls), per component",
            ["role", "component"], registry=r)
        self.transfers_succeeded = Counter(
            "kvbroker_transfers_succeeded", "Requests that ended SUCCEEDED, per component",
            ["role", "component"], registry=r)
        self.transfers_failed = Counter(
            "kvbroker_transfers_failed", "Requests that ended FAILED, per component and status code",
            ["role", "component", "code"], registry=r)
        self.bytes = Counter("kvbroker_transferred_bytes", "Bytes moved by succeeded requests",
                             ["role", "component"], registry=r)
        self.pages = Counter("kvbroker_transferred_pages", "Pages moved by succeeded requests (per layer buffer)",
                             ["role"], registry=r)
        self.runs = Counter("kvbroker_transferred_runs", "Runs moved by succeeded requests (per layer buffer)",
                            ["role"], registry=r)
        self.truncated = Counter("kvbroker_truncated_pages", "Grant entries succeeded requests left unfilled",
                                 ["role"], registry=r)
        self.duration = Histogram("kvbroker_transfer_duration_seconds",
                                  "Time from accepting a request to its end", ["role", "outcome"],
                                  buckets=SECONDS, registry=r)
        self.queue_wait = Histogram("kvbroker_transfer_queue_wait_seconds",
                                    "Time from accepting a request to TRANSFERRING", ["role"],
                                    buckets=SECONDS, registry=r)
        self.engines = Gauge("kvbroker_engines", "Engines registered", registry=r)
        self.registered_bytes = Gauge("kvbroker_registered_bytes", "Bytes of registered layer buffers",
                                      ["component"], registry=r)
        self.handshakes = Counter("kvbroker_peer_handshakes", "Handshakes completed with peer brokers", registry=r)
        self.epoch_changes = Counter("kvbroker_peer_epoch_changes",
                                     "Peer restarts noticed: a known peer answered a handshake with a new epoch",
                                     registry=r)
        self.notify_calls = Counter("kvbroker_peer_notify_calls",
                                    "Batches of part notices sent to peer brokers (NotifyParts calls or NotifyStream "
                                    "messages; each carries one or more part notices)",
                                    registry=r)
        self.notify_streamed = Counter("kvbroker_peer_notify_streamed",
                                       "Of kvbroker_peer_notify_calls, the batches sent as messages of the peer's "
                                       "NotifyStream rather than as NotifyParts calls", registry=r)
        self.offers = Counter("kvbroker_peer_offers",
                              "Grant offers sent to peer brokers (OfferGrant calls or NotifyStream messages)",
                              registry=r)
        self.offers_streamed = Counter("kvbroker_peer_offers_streamed",
                                       "Of kvbroker_peer_offers, those sent as messages of the peer's NotifyStream "
                                       "rather than as OfferGrant calls", registry=r)
        self.part_notices = Counter("kvbroker_peer_part_notices",
                                    "Part notices sent to peer brokers; over notify_calls: notices per call",
                                    registry=r)
        self.refused = Counter(
            "kvbroker_refused_requests",
            "Requests refused before their handler saw them (edge/admission.py), per port and reason",
            ["port", "reason"], registry=r)
        self.streams_open = Gauge("kvbroker_streams_open", "Streams the broker writes that are open, per stream "
                                  "(Exchange, WatchTransfer, OpenSession, NotifyStream)", ["stream"], registry=r)
        self.stream_replies = Gauge("kvbroker_stream_replies_held", "Replies the broker holds for clients that "
                                    "have not read them yet, per stream (bounded per stream by max_stream_replies)",
                                    ["stream"], registry=r)
        self.stream_reply_bytes = Gauge("kvbroker_stream_reply_bytes_held", "Bytes of kvbroker_stream_replies_held "
                                        "(bounded per stream by max_stream_reply_bytes)", ["stream"], registry=r)
        self.streams_stalled = Counter("kvbroker_streams_stalled", "Streams ended RESOURCE_EXHAUSTED because a "
                                       "reply waited stream_stall_s to be written, per stream", ["stream"],
                                       registry=r)
        self.exchange_commands = Gauge("kvbroker_exchange_commands", "Command slots of Exchange streams taken "
                                       "(commands in flight, and cancelled ones whose Broker call still runs)",
                                       registry=r)
        self.loop_tasks = Gauge("kvbroker_event_loop_tasks", "Tasks on the broker's event loop", registry=r)
        for stream in STREAMS:
            for family in (self.streams_open, self.stream_replies, self.stream_reply_bytes, self.streams_stalled):
                family.labels(stream)
        for kind in (Component.MAIN_KV, Component.MINIMAX_INDEX_K, Component.MINIMAX_DENSE_KV):  # zeros first
            self.registered_bytes.labels(kind.name)
            for role in ("sender", "receiver"):
                for counter in (self.transfers_started, self.transfers_succeeded, self.bytes):
                    counter.labels(role, kind.name)
        for role in ("sender", "receiver"):
            for counter in (self.pages, self.runs, self.truncated):
                counter.labels(role)
        for port, reasons in REFUSAL_REASONS.items():
            for reason in reasons:
                self.refused.labels(port, reason)
        self._page_bytes: dict[str, dict[Component, int]] = {}  # engine → bytes of one page per component
        self._http: tuple[WSGIServer, threading.Thread] | None = None
        self.messages = MessageCounts()
        r.register(self.messages)

    def engine_added(self, engine: Engine) -> None:
        self.engines.inc()
        self._page_bytes[engine.engine_id] = {}
        for kind, component in engine.layout.components.items():
            self.registered_bytes.labels(kind.name).inc(sum(b.length for b in component.buffers))
            self._page_bytes[engine.engine_id][kind] = component.page_bytes

    def engine_removed(self, engine: Engine) -> None:
        self.engines.dec()
        self._page_bytes.pop(engine.engine_id, None)
        for kind, component in engine.layout.components.items():
            self.registered_bytes.labels(kind.name).dec(sum(b.length for b in component.buffers))

    def transfer_changed(self, record: TransferRecord) -> None:
        role = record.role.name.lower()
        if record.state is TransferState.PENDING:
            for kind in record.components:
                self.transfers_started.labels(role, kind.name).inc()
        elif record.state is TransferState.TRANSFERRING:
            assert record.transferring_at is not None  # set as it entered TRANSFERRING
            self.queue_wait.labels(role).observe(record.transferring_at - record.started)
        elif record.state is TransferState.SUCCEEDED:
            page_bytes = self._page_bytes.get(record.engine_id, {})
            for kind in record.components:
                self.transfers_succeeded.labels(role, kind.name).inc()
                pages = record.component_pages.get(kind, 0) if record.component_pages else record.pages
                self.bytes.labels(role, kind.name).inc(pages * page_bytes.get(kind, 0))
            self.pages.labels(role).inc(record.pages)
            self.runs.labels(role).inc(record.runs)
            self.truncated.labels(role).inc(record.truncated_pages)
        else:
            code = code_name(record.code)
            for kind in record.components:
                self.transfers_failed.labels(role, kind.name, code).inc()
        if record.state.terminal:
            assert record.finished is not None  # set as it ended
            self.duration.labels(role, record.state.name.lower()).observe(record.finished - record.started)

    def peer_handshake(self, *, epoch_changed: bool) -> None:
        self.handshakes.inc()
        if epoch_changed:
            self.epoch_changes.inc()

    def peer_notify(self, notices: int, *, streamed: bool = False) -> None:
        """One batch of `notices` part notices to a peer (batched under load): a NotifyParts call, or
        with `streamed` a message of its NotifyStream."""
        self.notify_calls.inc()
        self.part_notices.inc(notices)
        if streamed:
            self.notify_streamed.inc()

    def peer_offer(self, *, streamed: bool) -> None:
        """One grant offer to a peer: an OfferGrant call, or with `streamed` a message of its NotifyStream."""
        self.offers.inc()
        if streamed:
            self.offers_streamed.inc()

    def stream_opened(self, stream: str) -> None:
        self.streams_open.labels(stream).inc()

    def stream_closed(self, stream: str) -> None:
        self.streams_open.labels(stream).dec()

    def replies_held(self, stream: str, replies: int, nbytes: int) -> None:
        """A stream's Outbox holds `replies` more replies of `nbytes` more bytes (negative: fewer)."""
        self.stream_replies.labels(stream).inc(replies)
        self.stream_reply_bytes.labels(stream).inc(nbytes)

    def stream_stalled(self, stream: str) -> None:
        self.streams_stalled.labels(stream).inc()

    def commands_held(self, delta: int) -> None:
        self.exchange_commands.inc(delta)

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count `loop`'s tasks when scraped (asyncio.all_tasks retries while the loop changes them)."""
        self.loop_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

    def refusal(self, port: str) -> Callable[[str], None]:
        """What Admission calls on `port` ("local" or "peer") for each request it refuses, with the
        refusal's reason."""
        counter = self.refused
        return lambda reason: counter.labels(port, reason).inc()

    def serve(self, address: str) -> str:
        """Serve /metrics on `address` (host:port) from a daemon thread; returns host:port as bound."""
        host, port = split_address(address)
        server, thread = start_http_server(port, host, registry=self.registry)
        self._http = (server, thread)
        bound = server.server_address[1]
        return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    async def close(self) -> None:
        if self._http is None:
            return
        server, thread = self._http
        self._http = None
        await asyncio.to_thread(server.shutdown)  # waits for serve_forever's poll: not on the loop
        server.server_close()
        await asyncio.to_thread(thread.join, 5.0)


class MessageCounts:
    """The gRPC messages each port of the broker read and wrote, per method: what a request costs in
    messages (each costs the broker 0.3-1 ms of CPU). Admission counts them as grpc parses and
    serializes them, on the event loop, into a plain dict (no lock on the hot path); a scrape reads a
    copy: kvbroker_grpc_messages_total{port, method, direction}."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}

    def key(self, port: str, method: str, direction: str) -> tuple[str, str, str]:
        """The key Admission counts one method's messages under: method as "Service/Method"."""
        key = (port, method.rsplit(".", 1)[-1], direction)
        self.counts.setdefault(key, 0)
        return key

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily("kvbroker_grpc_messages", "gRPC messages read (in) and written (out) per "
                                   "port and method", labels=("port", "method", "direction"))

    def describe(self):
        return [self._family()]

    def collect(self):
        family = self._family()
        for labels, value in list(self.counts.items()):
            family.add_metric(labels, value)
        yield family
