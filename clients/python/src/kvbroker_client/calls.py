"""How BrokerClient's calls reach the broker: `Calls.unary` sends a request on the Exchange stream
when the stream carries its method and the broker offers it, else as its unary RPC, and retries it
once after a broker restart (`Registrations.recover`); `Calls.watch` streams a request's states on
the Exchange stream, or on a WatchTransfer call where the broker has no Exchange stream;
`Calls.expect_watch` makes a grant and follows it to its end, one command on the Exchange stream,
else the ExpectTransfer call and a terminal-only watch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from kvbroker_client.errors import BrokerError, NotFound, Unavailable, from_rpc_error
from kvbroker_client.exchange import Exchange, ExchangeUnsupported, StreamBroken
from kvbroker_client.model import TransferStatus
from kvbroker_client.recovery import Registrations
from kvbroker_client.session import remaining
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

log = logging.getLogger("kvbroker_client.client")

EXCHANGED = {"Transfer": "transfer", "ExpectTransfer": "expect"}  # the unary RPCs the Exchange stream carries


class Calls:
    def __init__(self, stub: bpb_grpc.BrokerServiceStub, exchange: Exchange | None, target: str,
                 registrations: Registrations) -> None:
        self._stub = stub
        self.exchange = exchange
        self._target = target
        self._registrations = registrations

    def exchanged(self) -> bool:
        return self.exchange is not None and self.exchange.supported is not False

    async def unary(self, method: str, request, at: float, *, retry_unavailable: bool = True,
                    wait_for_ready: bool = False):
        """One call, by the deadline `at`; after a broker restart (see BrokerClient's map) it is retried once."""
        registrations = self._registrations
        seen = registrations.epoch
        try:
            return await self._call(method, request, at, wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            await self._recover_or_raise(from_rpc_error(exc), request, at, seen, retry_unavailable)
        except (Unavailable, NotFound) as exc:  # Unavailable: the Exchange stream broke under the command
            await self._recover_or_raise(exc, request, at, seen, retry_unavailable)
        try:
            return await self._call(method, request, at)
        except grpc.aio.AioRpcError as exc:
            raise registrations.explain_lost(from_rpc_error(exc), request) from None
        except NotFound as exc:
            raise registrations.explain_lost(exc, request) from None

    async def _recover_or_raise(self, error: BrokerError, request, at: float, seen: int | None,
                                retry_unavailable: bool = True) -> None:
        """A call failed with `error`: return when the broker restarted since epoch `seen` and the
        engines are registered again (the call may be made again); else raise the error."""
        registrations = self._registrations
        code = error.code
        may_be_restart = code is grpc.StatusCode.UNAVAILABLE or (
            code is grpc.StatusCode.NOT_FOUND and bool(registrations.engines))
        if not (may_be_restart and await registrations.recover(at, since=seen)):
            raise registrations.explain_lost(error, request)
        if code is grpc.StatusCode.UNAVAILABLE and not retry_unavailable:
            raise error

    async def _call(self, method: str, request, at: float, wait_for_ready: bool = False):
        """The call on the Exchange stream when it carries `method` and the broker offers it, else unary.
        Either way the reply is the unary RPC's response message."""
        if method in EXCHANGED and self.exchanged():
            assert self.exchange is not None
            kind = EXCHANGED[method]
            try:
                reply = await self.exchange.command(kind, request, remaining(at))
                return getattr(reply, kind)
            except StreamBroken as exc:
                raise Unavailable(str(exc)) from None
            except ExchangeUnsupported:
                log.info("broker %s has no Exchange stream; using its unary RPCs", self._target)
        return await getattr(self._stub, method)(request, timeout=remaining(at), wait_for_ready=wait_for_ready)

    async def watch(self, request: bpb.WatchTransferRequest, at: float) -> AsyncIterator[TransferStatus]:
        """The request's states until its end or the deadline `at` (BrokerClient.watch says which)."""
        if self.exchanged():
            try:
                async with contextlib.aclosing(self._watch_exchanged(request, at)) as statuses:
                    async for status in statuses:
                        yield status
                return
            except ExchangeUnsupported:
                pass
        call = self._stub.WatchTransfer(request, timeout=remaining(at))
        try:
            async for reply in call:
                yield TransferStatus.from_proto(reply.status)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED:
                # Our own cancellation arrives as CancelledError; a CANCELLED status is the server
                # cancelling the stream as it shuts down.
                raise Unavailable(f"the broker cut the watch of request {request.request_id!r}: "
                                  f"{exc.details()}") from None
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def expect_watch(self, request: bpb.ExpectTransferRequest, first_at: float,
                           at: float) -> AsyncIterator[TransferStatus]:
        """The grant's status (by `first_at`), then the request's terminal status (by `at`)."""
        if self.exchanged():
            assert self.exchange is not None
            seen, granted = self._registrations.epoch, False
            try:
                async with contextlib.aclosing(self.exchange.expect_watch(request, remaining(at),
                                                                          remaining(first_at))) as replies:
                    async for reply in replies:
                        granted = True
                        yield TransferStatus.from_proto(reply)
                return
            except ExchangeUnsupported:
                pass
            except (StreamBroken, NotFound) as exc:
                if granted and isinstance(exc, StreamBroken):  # the grant is made: see how the broker ended it
                    log.warning("%s; watching request %s again", exc, request.request_id)
                    async for status in self.watch(_end_of(request), at):
                        yield status
                    return
                if granted:
                    raise
                await self._recover_or_raise(Unavailable(str(exc)) if isinstance(exc, StreamBroken) else exc,
                                             request, first_at, seen)
        granted_reply = await self.unary("ExpectTransfer", request, first_at)
        yield TransferStatus.from_proto(granted_reply.status)
        async for status in self.watch(_end_of(request), at):
            yield status

    async def _watch_exchanged(self, request: bpb.WatchTransferRequest,
                               at: float) -> AsyncGenerator[TransferStatus, None]:
        """A watch on the Exchange stream; made again once on a new stream if this one breaks, so
        that the caller sees how the broker ended the request the broken stream carried."""
        assert self.exchange is not None
        for attempt in range(2):
            try:
                async with contextlib.aclosing(self.exchange.watch(request, remaining(at))) as replies:
                    async for reply in replies:  # left early, its close cancels the watch on the broker
                        yield TransferStatus.from_proto(reply)
                return
            except StreamBroken as exc:
                if attempt:
                    raise Unavailable(str(exc)) from None
                log.warning("%s; watching request %s again", exc, request.request_id)


def _end_of(request: bpb.ExpectTransferRequest) -> bpb.WatchTransferRequest:
    """The terminal-only watch of a grant."""
    return bpb.WatchTransferRequest(engine_id=request.engine_id, request_id=request.request_id, terminal_only=True)
