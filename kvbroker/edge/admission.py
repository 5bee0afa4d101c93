"""Bounds before work: what each gRPC server of the broker checks of a call before any handler sees it.
What a request may carry is request_limits.py's (pure, from the settings and the proto); the peer port's
shares per host are peer_quotas.py's; this module applies both to every call, refuses, logs and counts.

`Admission`, the server interceptor server.py installs on both ports, wraps every method of every
service there (kvbroker.v1, health, reflection):
- on the peer port (`PeerReads`), before the request is read: at most max_peer_reads requests are
  received and parsed at once, at most max_reads_per_peer of them for one peer host; other calls
  wait their turn with their request unread (grpc buffers at most a connection's window of it),
  and one that waits longer than peer_rpc_timeout_s is refused; a notice stream (NotifyStream) takes
  no read slot but one of StreamQuota's, as it opens, and each of its messages is read as it comes;
- the request's size against what its method may carry (`RequestLimits.bytes_for`), before parsing;
- request bytes that do not parse: INVALID_ARGUMENT (grpc itself would answer UNKNOWN and log a
  traceback each time);
- its lists against their bounds (`RequestLimits.check_lists`): page ids per list, layer buffers per
  engine, entries of any other list, before conversion builds anything from them.
A bound's refusal is RESOURCE_EXHAUSTED naming its setting. Each refusal is logged through a
LogThrottle (one line per kind and peer host per interval) and counted by its reason
(kvbroker_refused_requests_total). Big requests are noted to a MemoryTrim (trim.py), which hands
what they freed back to the system. A message over the port's limit (max_message_bytes,
max_peer_message_bytes) grpc refuses itself, unread, before any of this; on the peer port the
handler then reads no message, and that is counted as no_message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import Message

from kvbroker.edge.codes import details
from kvbroker.edge.peer_quotas import PeerReads, SlotTimeout, StreamQuota, peer_host
from kvbroker.edge.request_limits import COMMAND_STREAMS, NOTICE_STREAMS, Refusal, RequestLimits, leading_id
from kvbroker.ops.logs import LogThrottle
from kvbroker.ops.metrics import MessageCounts
from kvbroker.ops.trim import MemoryTrim

log = logging.getLogger(__name__)

NOTICE_STREAM_IDLE_S = 60.0  # a notice stream without a message for this long is ended (OK); the sender reopens


class Admission(grpc.aio.ServerInterceptor):
    def __init__(self, limits: RequestLimits, reads: PeerReads | None = None,
                 throttle: LogThrottle | None = None, trim: MemoryTrim | None = None,
                 counted: Callable[[str], None] | None = None, streams: StreamQuota | None = None,
                 unserved: frozenset[str] = frozenset(), messages: tuple[MessageCounts, str] | None = None) -> None:
        self.limits = limits
        self._unserved = unserved  # methods answered as grpc answers a method it does not know (UNIMPLEMENTED)
        self.reads = reads
        self.streams = streams or StreamQuota(1 << 30, 1 << 30)
        self._throttle = throttle or LogThrottle(log)
        self._trim = trim
        self._counted = counted  # told each refusal's reason (Metrics.refusal: kvbroker_refused_requests_total)
        self._messages = messages  # where this port's messages are counted, and the port's name

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self._unserved:
            return None
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = self._parser(method, handler.request_deserializer)
        serialize = handler.response_serializer
        if self._messages is not None:
            parse, serialize = _counting(parse, serialize, method, *self._messages)
        if handler.unary_unary is not None:
            if self.reads is None:
                return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), parse, serialize)
            return grpc.stream_unary_rpc_method_handler(self._held_unary(method, handler.unary_unary), parse,
                                                        serialize)
        if handler.unary_stream is not None:
            if self.reads is None:
                return grpc.unary_stream_rpc_method_handler(self._unary(method, handler.unary_stream, streams=True),
                                                            parse, serialize)
            return grpc.stream_stream_rpc_method_handler(self._held_unary(method, handler.unary_stream, streams=True),
                                                         parse, serialize)
        if handler.stream_stream is not None and method in NOTICE_STREAMS:
            return grpc.stream_stream_rpc_method_handler(self._notice_stream(method, handler.stream_stream),
                                                         parse, serialize)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(self._streaming(method, handler.stream_stream, streams=True),
                                                         parse, serialize)
        return grpc.stream_unary_rpc_method_handler(self._streaming(method, handler.stream_unary), parse, serialize)

    def _parser(self, method: str, deserialize: Callable[[bytes], Message] | None):
        most, why = self.limits.bytes_for(method)

        commands = method in COMMAND_STREAMS

        def parse(data: bytes):
            if self._trim is not None:
                self._trim.note(len(data))
            if len(data) > most:
                return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request: {len(data)} bytes exceed the {most} a request of {method} may take ({why})",
                               "too_large", leading_id(data) if commands else None)
            if deserialize is None:
                return data
            try:
                request = deserialize(data)
            except Exception as exc:  # DecodeError, or whatever a deserializer raises
                return Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request: not a valid message for {method}: {exc}", "malformed",
                               leading_id(data) if commands else None)
            if isinstance(request, Message):
                refusal = self.limits.check_lists(request)
                if refusal is not None and commands:
                    return dataclasses.replace(refusal, command_id=getattr(request, "command_id", None))
                return refusal or request
            return request

        return parse

    async def _refuse(self, refusal: Refusal, method: str, context) -> None:
        self._log(refusal, method, context)
        await context.abort(refusal.code, details(refusal.message))

    def _log(self, refusal: Refusal, method: str, context) -> None:
        host = peer_host(context.peer())
        if self._counted is not None:
            self._counted(refusal.kind)
        self._throttle.warning((refusal.kind, host), "refused a request: %s", refusal.message,
                               extra={"peer": host, "method": method})

    def _unary(self, method: str, inner, streams: bool = False):
        """A unary-request method as it was, refusing what the parser refused."""
        async def call(request, context):
            if isinstance(request, Refusal):
                await self._refuse(request, method, context)
            try:
                return await inner(request, context)
            except grpc.aio.AbortError as exc:
                request = None  # noqa: F841 -- what the abort's traceback would keep alive
                raise _bare(exc) from None

        async def call_streaming(request, context):
            if isinstance(request, Refusal):
                await self._refuse(request, method, context)
            try:
                await _respond(inner(request, context), context)
            except grpc.aio.AbortError as exc:
                request = None  # noqa: F841
                raise _bare(exc) from None

        return call_streaming if streams else call

    def _held_unary(self, method: str, inner, streams: bool = False):
        """A unary-request method taken as a streaming one, so that its request is read only in its
        turn (PeerReads)."""
        async def call(request_iterator, context):
            request = await self._read(method, context, one=True)
            try:
                if streams:
                    await _respond(inner(request, context), context)
                    return None
                return await inner(request, context)
            except grpc.aio.AbortError as exc:
                request = None  # noqa: F841 -- what the abort's traceback would keep alive
                raise _bare(exc) from None

        return call

    def _streaming(self, method: str, inner, streams: bool = False):
        """A streaming-request method (reflection): each request read like a unary one's."""
        async def call(request_iterator, context):
            async def requests():
                if self.reads is None:
                    async for request in request_iterator:
                        if isinstance(request, Refusal):
                            if request.command_id is None:
                                await self._refuse(request, method, context)
                            self._log(request, method, context)  # the handler answers that command alone
                        yield request
                    return
                while (request := await self._read(method, context, one=False)) is not grpc.aio.EOF:
                    yield request

            result = inner(requests(), context)
            if streams:
                await _respond(result, context)
                return None
            return await result

        return call

    def _notice_stream(self, method: str, inner):
        """A notice stream: counted against StreamQuota while it is open, and told so by its initial
        metadata; each message read as it comes, without a read slot; ended (OK) after
        NOTICE_STREAM_IDLE_S without one; a refused message ends the stream with its refusal."""
        async def call(request_iterator, context):
            host = peer_host(context.peer())
            if (why := self.streams.enter(host)) is not None:
                refusal = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"NotifyStream: {why}", "notice_streams")
                await self._refuse(refusal, method, context)
            try:
                # Admitted: the sender waits for this before its first message, so that a refusal never
                # races its write (grpc may then report INTERNAL instead of the refusal's status).
                await context.send_initial_metadata(())
                async def requests():
                    while True:
                        try:
                            async with asyncio.timeout(NOTICE_STREAM_IDLE_S):
                                request = await context.read()
                        except TimeoutError:
                            return
                        if request is grpc.aio.EOF:
                            return
                        if isinstance(request, Refusal):
                            await self._refuse(request, method, context)
                        yield request

                await _respond(inner(requests(), context), context)
            except grpc.aio.AbortError as exc:
                raise _bare(exc) from None
            finally:
                self.streams.leave(host)

        return call

    async def _read(self, method: str, context, *, one: bool):
        """The call's next request through PeerReads; a refused one aborts the call. With `one`, the
        call's only request: none at all is malformed."""
        host, reads = peer_host(context.peer()), self.reads
        assert reads is not None  # only the peer port's calls are read through PeerReads
        try:
            request = await reads.read(context, host)
        except SlotTimeout:
            await self._refuse(Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: not read within {reads.wait_s:g}s, behind {reads.waiting(host)} other calls of "
                f"{host} (max_peer_reads={reads.reads}, max_reads_per_peer={reads.per_host})",
                "no_read_slot"), method, context)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request: not received within {reads.wait_s:g}s (peer_rpc_timeout_s)")
        if request is grpc.aio.EOF and one:
            # grpc core ends a call whose message is over the port's limit with its own status, and
            # the handler reads no message: that too is counted here, as a call without one.
            await self._refuse(Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"request: {method} takes one request "
                                       "message, none came", "no_message"), method, context)
        if isinstance(request, Refusal):
            await self._refuse(request, method, context)
        return request


def _counting(parse: Callable, serialize: Callable | None, method: str, counts: MessageCounts, port: str):
    """`parse` and `serialize` that count each message read and written (MessageCounts)."""
    table = counts.counts
    read, written = counts.key(port, method, "in"), counts.key(port, method, "out")

    def counted_parse(data: bytes):
        table[read] += 1
        return parse(data)

    def counted_serialize(message) -> bytes:
        table[written] += 1
        return serialize(message) if serialize is not None else message

    return counted_parse, counted_serialize


def _bare(exc: BaseException) -> BaseException:
    """`exc` without its traceback and the exception it replaced. grpc keeps a handler's AbortError on
    the call's state, and through them the handler's frames and so the request, in a reference cycle
    that only the cyclic collector frees: a flood of big refused requests would stay in memory."""
    exc.__context__ = exc.__cause__ = None
    return exc.with_traceback(None)


async def _respond(result, context) -> None:
    """Send a streaming handler's replies: an async generator's items, or a coroutine's own writes."""
    if inspect.isasyncgen(result):
        async with contextlib.aclosing(result):
            async for reply in result:
                await context.write(reply)
    else:
        await result
