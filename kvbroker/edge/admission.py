"""Bounds before work: what each gRPC server of the broker checks of a call before any handler sees it.

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
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from kvbroker.config import SMALL_MESSAGE_BYTES, page_list_bytes
from kvbroker.edge.codes import details
from kvbroker.ops.logs import LogThrottle
from kvbroker.ops.trim import MemoryTrim

log = logging.getLogger(__name__)

MAX_LIST_ENTRIES = 1024  # any list of a request other than page ids and layer buffers (components, notices)
LAYER_BUFFER_BYTES = 512  # the most one LayerBuffer message takes: ids, lengths, a segment name or a CUDA handle
# Page lists a request of each method may carry, each of up to max_pages_per_request ids; methods
# not named here carry none and take SMALL_MESSAGE_BYTES, but for the ones below.
PAGE_LISTS = {
    "/kvbroker.v1.BrokerService/ExpectTransfer": 5,  # dst_page_ids, or one list per component
    "/kvbroker.v1.BrokerService/Transfer": 6,  # src_page_ids and dst_page_ids, or one source list per component
    "/kvbroker.v1.BrokerService/Exchange": 6,  # each message: one Transfer or one ExpectTransfer
    "/kvbroker.v1.PeerService/ClaimGrant": 1,
    "/kvbroker.v1.PeerService/OfferGrant": 4,
}
LAYER_BUFFER_METHODS = {"/kvbroker.v1.BrokerService/RegisterEngine"}
# Streams whose messages are commands answered one by one (edge/exchange.py): a refused message is
# handed to the handler, to answer under its command_id, and the stream goes on.
COMMAND_STREAMS = {"/kvbroker.v1.BrokerService/Exchange"}
WHOLE_MESSAGE_METHODS = {"/kvbroker.v1.PeerService/NotifyParts"}  # notices with aux payloads: the port's limit
# Long-lived peer streams (NotifyStream): a stream holds no read slot of PeerReads while it waits for
# its next message, which may be long; instead the streams are bounded in number (StreamQuota), and
# each message to RequestLimits.notice_bytes, so that what they can hold at once is bounded.
NOTICE_STREAMS = {"/kvbroker.v1.PeerService/NotifyStream"}
NOTICE_STREAM_IDLE_S = 60.0  # a notice stream without a message for this long is ended (OK); the sender reopens


@dataclass(frozen=True)
class Refusal:
    """What the parser hands the handler instead of a request it refused."""

    code: grpc.StatusCode
    message: str
    kind: str  # the reason, for the log throttle and the refusal counter (REFUSAL_REASONS)
    command_id: int | None = None  # a command stream's message: its command_id, when it could be read


@dataclass(frozen=True)
class RequestLimits:
    """The sizes and counts a request on one port may have; pure, from the settings."""

    port_bytes: int  # grpc's limit on the port
    port_setting: str  # the setting that sets it
    max_pages: int  # max_pages_per_request
    max_layer_buffers: int
    notice_bytes: int = 1 << 20  # one message of a notice stream (server.py: notice_stream_bytes)

    def bytes_for(self, method: str) -> tuple[int, str]:
        """The most a request of `method` may take on the wire, and what says so."""
        if method in NOTICE_STREAMS and self.notice_bytes < self.port_bytes:
            return self.notice_bytes, "1 MiB, or max_aux_bytes plus 64 KiB, per message of a notice stream"
        if method in WHOLE_MESSAGE_METHODS or method in NOTICE_STREAMS:
            return self.port_bytes, self.port_setting
        if method in LAYER_BUFFER_METHODS:
            most, why = self.max_layer_buffers * LAYER_BUFFER_BYTES, f"max_layer_buffers={self.max_layer_buffers}"
        elif method in PAGE_LISTS:
            lists = PAGE_LISTS[method]
            most = lists * page_list_bytes(self.max_pages)
            why = f"{lists} page list{'s' if lists > 1 else ''} of max_pages_per_request={self.max_pages}"
        else:
            most, why = 0, "no page lists"
        most += SMALL_MESSAGE_BYTES
        if most >= self.port_bytes:
            return self.port_bytes, self.port_setting
        return most, why

    def check_lists(self, request: Message) -> Refusal | None:
        """The first list of `request` over its bound, as a refusal; None when all are within."""
        buffers = 0
        stack = [request]
        while stack:
            message = stack.pop()
            nested = _nested_lists(message.DESCRIPTOR)
            for field, value in message.ListFields():
                if field.is_repeated:
                    count = len(value)
                    if field.name.endswith("page_ids"):
                        if count > self.max_pages:
                            return self._too_many(f"{field.name}: {count} page ids exceed the limit of "
                                                  f"{self.max_pages} per request (max_pages_per_request)")
                    elif field.name == "layer_buffers":
                        buffers += count
                        if buffers > self.max_layer_buffers:
                            return self._too_many(f"layer_buffers: more than {self.max_layer_buffers} layer buffers "
                                                  f"in one engine (max_layer_buffers)")
                    elif count > MAX_LIST_ENTRIES:
                        return self._too_many(f"{field.name}: {count} entries exceed the {MAX_LIST_ENTRIES} any "
                                              "list of the API holds")
                    if field.name in nested:
                        stack.extend(value)
                elif field.name in nested:
                    stack.append(value)
        return None

    @staticmethod
    def _too_many(message: str) -> Refusal:
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "too_many_entries")


_NESTED: dict[str, frozenset[str]] = {}


def _nested_lists(descriptor: Descriptor) -> frozenset[str]:
    """Names of the message fields of `descriptor` whose type holds a list somewhere below (cached):
    only those are walked, so a request's layer buffers, say, are counted but never visited."""
    found = _NESTED.get(descriptor.full_name)
    if found is None:
        found = frozenset(f.name for f in descriptor.fields
                          if f.type == FieldDescriptor.TYPE_MESSAGE and _holds_lists(f.message_type, set()))
        _NESTED[descriptor.full_name] = found
    return found


def _holds_lists(descriptor: Descriptor, seen: set[str]) -> bool:
    if descriptor.full_name in seen:
        return False
    seen.add(descriptor.full_name)
    return any(f.is_repeated or (f.type == FieldDescriptor.TYPE_MESSAGE and _holds_lists(f.message_type, seen))
               for f in descriptor.fields)


def peer_host(peer: str) -> str:
    """"ipv4:10.0.0.7:41234" → "ipv4:10.0.0.7": what calls from one peer have in common."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class SlotTimeout(Exception):
    """No read slot came free within PeerReads.wait_s."""


class PeerReads:
    """The peer port's reads: at most `reads` requests received and parsed at once, at most `per_host`
    of them for one peer host, so that no host holds them all. A call waits for its turn with its
    request unread, up to `wait_s`; the read itself has `wait_s` too."""

    def __init__(self, reads: int, per_host: int, wait_s: float) -> None:
        self.reads = reads
        self.per_host = per_host
        self.wait_s = wait_s
        self._all = asyncio.Semaphore(reads)
        self._hosts: dict[str, list] = {}  # host -> [its semaphore, calls holding or waiting for it]

    def waiting(self, host: str) -> int:
        entry = self._hosts.get(host)
        return entry[1] if entry is not None else 0

    async def read(self, context: grpc.aio.ServicerContext, host: str):
        """The call's next request, read in turn. SlotTimeout when no turn came within wait_s,
        TimeoutError when the request did not arrive within wait_s of its turn."""
        entry = self._hosts.setdefault(host, [asyncio.Semaphore(self.per_host), 0])
        entry[1] += 1
        try:
            try:
                async with asyncio.timeout(self.wait_s):
                    await entry[0].acquire()
                    try:
                        await self._all.acquire()
                    except BaseException:
                        entry[0].release()
                        raise
            except TimeoutError:
                raise SlotTimeout from None
            try:
                async with asyncio.timeout(self.wait_s):
                    return await context.read()
            finally:
                self._all.release()
                entry[0].release()
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._hosts[host]


class StreamQuota:
    """The notice streams the peer port holds at once: at most `total`, at most `per_host` of one peer
    host. One more is refused as it opens, before any of its messages is read."""

    def __init__(self, total: int, per_host: int) -> None:
        self.total = total
        self.per_host = per_host
        self._hosts: dict[str, int] = {}
        self._open = 0

    def enter(self, host: str) -> str | None:
        """Count one more stream of `host`; or why not, naming the setting."""
        if self._open >= self.total:
            return f"{self._open} notice streams are open, the most this broker holds (max_peer_notice_streams)"
        if self._hosts.get(host, 0) >= self.per_host:
            return (f"{host} holds {self.per_host} notice streams, the most one peer host may "
                    "(max_notice_streams_per_peer)")
        self._open += 1
        self._hosts[host] = self._hosts.get(host, 0) + 1
        return None

    def leave(self, host: str) -> None:
        self._open -= 1
        self._hosts[host] -= 1
        if not self._hosts[host]:
            del self._hosts[host]


class Admission(grpc.aio.ServerInterceptor):
    def __init__(self, limits: RequestLimits, reads: PeerReads | None = None,
                 throttle: LogThrottle | None = None, trim: MemoryTrim | None = None,
                 counted: Callable[[str], None] | None = None, streams: StreamQuota | None = None,
                 unserved: frozenset[str] = frozenset()) -> None:
        self.limits = limits
        self._unserved = unserved  # methods answered as grpc answers a method it does not know (UNIMPLEMENTED)
        self.reads = reads
        self.streams = streams or StreamQuota(1 << 30, 1 << 30)
        self._throttle = throttle or LogThrottle(log)
        self._trim = trim
        self._counted = counted  # told each refusal's reason (Metrics.refusal: kvbroker_refused_requests_total)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self._unserved:
            return None
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = self._parser(method, handler.request_deserializer)
        serialize = handler.response_serializer
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
                    return dataclasses.replace(refusal, command_id=request.command_id)  # type: ignore[attr-defined]
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
        host = peer_host(context.peer())
        try:
            request = await self.reads.read(context, host)
        except SlotTimeout:
            await self._refuse(Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: not read within {self.reads.wait_s:g}s, behind {self.reads.waiting(host)} other calls of "
                f"{host} (max_peer_reads={self.reads.reads}, max_reads_per_peer={self.reads.per_host})",
                "no_read_slot"), method, context)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request: not received within {self.reads.wait_s:g}s (peer_rpc_timeout_s)")
        if request is grpc.aio.EOF and one:
            # grpc core ends a call whose message is over the port's limit with its own status, and
            # the handler reads no message: that too is counted here, as a call without one.
            await self._refuse(Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"request: {method} takes one request "
                                       "message, none came", "no_message"), method, context)
        if isinstance(request, Refusal):
            await self._refuse(request, method, context)
        return request


def leading_id(data: bytes) -> int | None:
    """The command_id of a command stream's message from its first bytes, without parsing the rest:
    field 1 as a varint, which protobuf writes first; None when the message does not start so."""
    if not data or data[0] != 0x08:
        return None
    value = 0
    for i, byte in enumerate(data[1:11]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value if value < 1 << 64 else None
    return None


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
