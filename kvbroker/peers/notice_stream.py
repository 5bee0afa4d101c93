"""Part notices and grant offers on one long-lived NotifyStream per peer address: the sending side
(the receiving side is edge/peer_service.py's NotifyStream, bounded by edge/admission.py).

Each batch the Notifier sends, and each offer of at most OFFER_BYTES, is one request on its
address's stream, numbered by its `seq`; the peer answers the requests in order. An offer answered
without an `offer` (a broker whose stream reads notices only) goes as an OfferGrant call, as does
every later one to that address until it is forgotten. A request waits for its answer up to its
timeout; one that gets none ends the stream, as a silent unary call makes its channel be
forgotten. When a stream ends, the requests it still carried unanswered:
- after OK, RESOURCE_EXHAUSTED (the peer's admission refused the stream, or a message, before
  reading it) or UNIMPLEMENTED (a broker that does not serve it) were read by no handler: `send`
  raises Resend, and the caller sends them as NotifyParts (OfferGrant) calls; after UNIMPLEMENTED
  every later batch to that address goes so too, until the address is forgotten;
- after any other end the peer may have taken them or not, as with a unary call that failed: they
  fail with the stream's status, and the next batch opens a new stream.
A stream without a request for IDLE_S is closed from this side (its peer would end it after
admission.NOTICE_STREAM_IDLE_S); one on a channel that was replaced (new TLS files) is closed once
its requests are answered, and the next batch opens one on the new channel.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.tasks import OwnedTasks
from kvbroker.ops.metrics import Metrics
from kvbroker.peers.idle import IdlePeers
from kvbroker.peers.link import ReplyBounds
from kvbroker.peers.wire import from_rpc_error, from_status
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc

IDLE_S = 10.0  # a stream without a request for this long is closed; well under the peer's idle bound
OFFER_BYTES = 512 << 10  # the biggest offer sent on a stream: half the least a peer's stream takes a message of
UNREAD = (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED)


class Resend(Exception):
    """The peer read none of the request: send it as a unary call (NotifyParts, OfferGrant)."""


@dataclass(eq=False)
class _Stream:
    call: grpc.aio.StreamStreamCall
    stub: ppb_grpc.PeerServiceStub
    used: float
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    admitted: bool = False  # its peer sent initial metadata: the stream passed admission
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)


class NoticeStreams:
    """A batch of notices, or an offer, to a peer: on its stream when `enabled` and the peer serves
    it, else by a NotifyParts (OfferGrant) call through `rpc` (PeerClients._rpc: address, method,
    request, timeout)."""

    def __init__(self, stub_for: Callable[[str], ppb_grpc.PeerServiceStub], silent: Callable[[str], None],
                 rpc: Callable[[str, str, Message, float], Awaitable[Message]], *,
                 enabled: bool, idle: IdlePeers, limits: ReplyBounds | None, metrics: Metrics | None,
                 idle_s: float = IDLE_S) -> None:
        self._stub_for = stub_for  # the address's current channel's stub (channels.PeerChannels.stub)
        self._silent = silent  # told of an address whose stream went unanswered or unavailable (forget it)
        self._rpc = rpc
        self._enabled = enabled
        self._idle = idle  # a stream's request in flight keeps its address from being forgotten as idle
        self._limits = limits  # the peer's answer is held to our bounds
        self._metrics = metrics
        self._idle_s = idle_s
        self._streams: dict[str, _Stream] = {}
        self._old: set[str] = set()  # addresses whose broker answered UNIMPLEMENTED
        self._no_offers: set[str] = set()  # addresses whose broker's stream reads notices only
        self._seq = itertools.count(1)
        self._tasks = OwnedTasks()

    async def send(self, address: str, request: ppb.NotifyPartsRequest, timeout: float) -> list[ppb.PartAck]:
        """The peer's acks to a batch of notices; its refusal or failure as a BrokerError."""
        reply = None
        if self._enabled and address not in self._old:
            reply = await self._on_stream(address, ppb.NotifyStreamRequest(notices=request), timeout)
        if self._metrics is not None:
            self._metrics.peer_notify(len(request.notices), streamed=reply is not None)
        if reply is None:
            return list((await self._rpc(address, "NotifyParts", request, timeout)).acks)
        return list(reply.acks.acks)

    async def offer(self, address: str, request: ppb.OfferGrantRequest, timeout: float) -> ppb.OfferGrantResponse:
        """The peer's answer to an offer; its refusal or failure as a BrokerError. On the address's
        stream when it is small enough (OFFER_BYTES) and the peer reads offers there, else an
        OfferGrant call."""
        reply = None
        if self._enabled and address not in self._old and address not in self._no_offers \
                and request.ByteSize() <= OFFER_BYTES:
            carrier = ppb.NotifyStreamRequest(
                notices=ppb.NotifyPartsRequest(broker_id=request.broker_id, epoch=request.epoch), offer=request)
            reply = await self._on_stream(address, carrier, timeout)
            if reply is not None and not reply.HasField("offer"):
                self._no_offers.add(address)  # a broker that reads notices only: it took none of this
                reply = None
        if self._metrics is not None:
            self._metrics.peer_offer(streamed=reply is not None)
        if reply is None:
            return await self._rpc(address, "OfferGrant", request, timeout)
        return reply.offer

    async def _on_stream(self, address: str, request: ppb.NotifyStreamRequest,
                         timeout: float) -> ppb.NotifyStreamResponse | None:
        """The peer's answer to `request` on the address's stream; None when the peer read none of
        it (the caller sends it as a unary call); its refusal or the stream's failure as a
        BrokerError."""
        self._idle.begin(address)
        try:
            reply = await self._streamed(address, request, timeout)
        except Resend:
            return None
        finally:
            self._idle.end(address)
        if self._limits is not None and (refusal := self._limits.check_lists(reply)) is not None:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, f"peer broker {address}: NotifyStream answer: "
                                                       f"{refusal.message}")
        if reply.code:
            raise from_status(reply.code, reply.reason[:1024], f"peer broker {address}")
        return reply

    def forget(self, address: str) -> None:
        """The address was forgotten: its stream ends (what it carried fails), and the next batch
        tries a stream again."""
        self._old.discard(address)
        self._no_offers.discard(address)
        stream = self._streams.pop(address, None)
        if stream is not None:
            stream.call.cancel()

    async def _streamed(self, address: str, request: ppb.NotifyStreamRequest,
                        timeout: float) -> ppb.NotifyStreamResponse:
        """The peer's answer to `request` (its seq set here), sent on the address's stream. Raises
        Resend, or the stream's failure as a BrokerError."""
        loop = asyncio.get_running_loop()
        stream = self._stream(address, loop)
        seq = next(self._seq)
        request.seq = seq
        answer = loop.create_future()
        stream.pending[seq] = answer
        stream.used = loop.time()
        try:
            async with asyncio.timeout(timeout):
                async with stream.writing:
                    try:
                        if not stream.admitted:  # a refusal then comes before any write (admission.py)
                            await stream.call.initial_metadata()
                            stream.admitted = True
                        await stream.call.write(request)
                    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                        pass  # the stream ended: its reader settles the answer
                return await answer
        except TimeoutError:
            if self._streams.get(address) is stream:
                del self._streams[address]
            stream.call.cancel()
            self._silent(address)
            raise BrokerError(Code.UNAVAILABLE, f"peer broker {address}: no answer on its notice stream within "
                                                f"{timeout:.3f}s") from None
        finally:
            stream.pending.pop(seq, None)

    def _stream(self, address: str, loop: asyncio.AbstractEventLoop) -> _Stream:
        stub = self._stub_for(address)
        stream = self._streams.get(address)
        if stream is not None and stream.stub is stub:
            return stream
        if stream is not None:  # its channel was replaced: it ends once its requests are answered
            self._tasks.spawn(self._close_writing(stream), f"notice stream {address} retired")
        stream = _Stream(stub.NotifyStream(wait_for_ready=False), stub, loop.time())
        self._streams[address] = stream
        self._tasks.spawn(self._read(address, stream), f"notice stream {address}")
        loop.call_later(self._idle_s, self._if_idle, address, stream)
        return stream

    def _if_idle(self, address: str, stream: _Stream) -> None:
        if self._streams.get(address) is not stream:
            return
        loop = asyncio.get_running_loop()
        idle = loop.time() - stream.used
        if stream.pending or idle < self._idle_s:
            loop.call_later(self._idle_s - min(idle, self._idle_s) + 0.01, self._if_idle, address, stream)
            return
        del self._streams[address]
        self._tasks.spawn(self._close_writing(stream), f"notice stream {address} idle")

    @staticmethod
    async def _close_writing(stream: _Stream) -> None:
        async with stream.writing:
            try:
                await stream.call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # ended already

    async def _read(self, address: str, stream: _Stream) -> None:
        failure: BaseException
        try:
            async for reply in stream.call:
                answer = stream.pending.get(reply.seq)
                if answer is not None and not answer.done():
                    answer.set_result(reply)
            failure = Resend()  # ended OK: what it still carried was not read
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREAD:
                failure = Resend()
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    self._old.add(address)
            else:
                failure = from_rpc_error(exc, f"peer broker {address} (notice stream)")
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self._silent(address)
        except asyncio.CancelledError:
            task = asyncio.current_task()  # this coroutine's: never None here
            if task is not None and task.cancelling():
                self._settle(stream, BrokerError(Code.UNAVAILABLE, "broker is shutting down"))
                raise
            failure = BrokerError(Code.UNAVAILABLE, f"peer broker {address}: its notice stream was closed")
        finally:
            if self._streams.get(address) is stream:
                del self._streams[address]
        self._settle(stream, failure)

    @staticmethod
    def _settle(stream: _Stream, failure: BaseException) -> None:
        for answer in stream.pending.values():
            if not answer.done():
                answer.set_exception(failure)
                answer.exception()  # retrieved: its sender, if it still waits, raises it

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.call.cancel()
        self._streams.clear()
        await self._tasks.cancel(5)
