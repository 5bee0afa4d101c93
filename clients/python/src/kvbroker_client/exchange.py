"""The client's end of BrokerService.Exchange: one long-lived command stream to the local broker.

`Exchange` is BrokerClient's, which sends its Transfer and ExpectTransfer calls and its watches here
while the broker offers the stream:
- `command(kind, request, timeout)`: one command (kind "transfer" or "expect"), its reply message,
  or the typed error (kvbroker_client.errors) of the ExchangeError the broker answered;
- `watch(request, timeout)`: the statuses of one request, ending after a terminal one; the broker
  ends the watch at the same deadline (timeout_ms);
- `expect_watch(request, timeout, first_timeout)`: an ExpectTransfer and its grant's end as one
  command: the grant's status, then its terminal one;
- a transfer command with `end_watches` whose reply is SUCCEEDED ends this stream's watches of its
  request: the broker sends them nothing more, and the reader hands each that reply's status as its
  last, before the transfer's caller sees the reply;
- `close()`.
Each command goes out under an id of its own, and one reader task hands each reply to its caller.
A caller that stops waiting before the command's last reply (its deadline passed, it was
cancelled, it stopped iterating a watch) leaves nothing behind on the broker: a cancel naming the
command goes out on the same stream (ExchangeCancel), sent and answered in a task the Exchange owns,
so that the broker frees the command's slot at once.
When the stream breaks (the broker went, or drained), every command in flight raises StreamBroken
(an Unavailable: its outcome is unknown), and the next command opens a new stream; the broker fails
the requests the broken stream carried (CANCELLED), which a watch made again on the new stream
sees. A broker without the RPC answers UNIMPLEMENTED: `supported` turns False and every caller
raises ExchangeUnsupported, for BrokerClient to use the unary RPCs instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator

import grpc

from kvbroker_client.codes import status_code
from kvbroker_client.errors import DeadlineExceeded, error_for_code, from_rpc_error
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

_TERMINAL = (pb.TRANSFER_STATE_SUCCEEDED, pb.TRANSFER_STATE_FAILED)
CANCEL_WAIT_S = 10.0  # how long a cancel of a command its caller left waits for the broker's answer


class StreamBroken(Exception):
    """The Exchange stream ended while the command was in flight: its outcome is unknown. BrokerClient
    raises it as Unavailable."""


class ExchangeUnsupported(Exception):
    """The broker has no Exchange RPC (UNIMPLEMENTED): use the unary RPCs."""


class Exchange:
    def __init__(self, stub: bpb_grpc.BrokerServiceStub, target: str) -> None:
        self._stub = stub
        self._target = target
        self.supported: bool | None = None  # None until the broker answered a first command
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._open_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()  # grpc takes one write at a time
        self._ids = itertools.count(1)
        w = self._waiters = _Waiters()
        self._pending, self._watches, self._watched, self._enders = w.pending, w.watches, w.watched, w.enders
        self._cancels: set[asyncio.Task] = set()  # cancels of commands their callers left, on their way
        self.streams_opened = self.cancels_sent = 0
        self.commands_sent = 0  # messages written on the stream (cancels included)
        self.replies_read = 0  # messages read from it

    async def cancels_answered(self, timeout: float) -> bool:
        """Whether every cancel of a left command was answered (or given up on) within `timeout`."""
        if self._cancels:
            await asyncio.wait(list(self._cancels), timeout=timeout)
        return not self._cancels

    async def command(self, kind: str, request, timeout: float) -> bpb.ExchangeResponse:
        """Send one command and wait up to `timeout` for its reply."""
        command_id = next(self._ids)
        future: asyncio.Future[bpb.ExchangeResponse] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        if kind == "transfer" and request.end_watches:
            self._enders[command_id] = (request.engine_id, request.request_id)
        call = None
        try:
            call = await self._send(bpb.ExchangeRequest(command_id=command_id, timeout_ms=_ms(timeout),
                                                        **{kind: request}), timeout)
            try:
                reply = await asyncio.wait_for(future, timeout)
            except TimeoutError:
                raise DeadlineExceeded(f"no answer to the {kind} command within {timeout:.3g}s") from None
        finally:
            self._pending.pop(command_id, None)
            self._enders.pop(command_id, None)
            if call is not None and not future.done():
                self._abandon(call, command_id)
        if reply.WhichOneof("reply") == "error":
            raise _error(reply.error)
        return reply

    async def ping(self, timeout: float, payload: bytes = b"") -> None:
        """A bare message and its answer (the stream's own cost)."""
        await self.command("ping", bpb.ExchangePing(payload=payload), timeout)

    def watch(self, request: bpb.WatchTransferRequest, timeout: float) -> AsyncGenerator[bpb.TransferStatus, None]:
        """The request's statuses on this stream, until a terminal one; StreamBroken if it breaks first."""
        return self._followed("watch", request, timeout, timeout)

    def expect_watch(self, request: bpb.ExpectTransferRequest, timeout: float,
                     first_timeout: float) -> AsyncGenerator[bpb.TransferStatus, None]:
        """The grant's status (its ExpectTransfer's reply, within `first_timeout`), then its terminal status."""
        return self._followed("expect_watch", request, timeout, first_timeout)

    async def _followed(self, kind: str, request, timeout: float,
                        first_timeout: float) -> AsyncGenerator[bpb.TransferStatus, None]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        first_by = min(deadline, loop.time() + first_timeout)
        command_id = next(self._ids)
        queue: asyncio.Queue[bpb.ExchangeResponse | BaseException] = asyncio.Queue()
        self._watches[command_id], self._watched[command_id] = queue, (request.engine_id, request.request_id)
        call, ended, replies = None, False, 0
        try:
            call = await self._send(bpb.ExchangeRequest(command_id=command_id, timeout_ms=_ms(timeout),
                                                        **{kind: request}), timeout)
            while True:
                by = deadline if replies else first_by
                try:
                    item = await asyncio.wait_for(queue.get(), max(0.0, by - loop.time()))
                except TimeoutError:
                    if replies or kind == "watch":
                        raise DeadlineExceeded(f"the watch of request {request.request_id!r} did not end within "
                                               f"{timeout:.3g}s") from None
                    raise DeadlineExceeded(f"no answer to the grant of request {request.request_id!r} within "
                                           f"{first_timeout:.3g}s") from None
                replies += 1
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                which = item.WhichOneof("reply")
                if which == "error":
                    ended = True
                    raise _error(item.error)
                status = item.expect.status if which == "expect" else item.watch.status
                ended = which == "watch" and status.state in _TERMINAL
                yield status
                if ended:
                    return
        finally:
            self._watches.pop(command_id, None)
            self._watched.pop(command_id, None)
            if call is not None and not ended:
                self._abandon(call, command_id)

    def _abandon(self, call: grpc.aio.StreamStreamCall, command_id: int) -> None:
        """The caller left command `command_id` before its last reply: cancel it on the broker, from a task
        of this Exchange (a caller may leave from a finally, a generator's close, or a cancellation)."""
        if self._call is None or call is not self._call or call.done():
            return  # the stream it went on is gone, and the broker ended its commands with it
        task = asyncio.get_running_loop().create_task(self._cancel(call, command_id),
                                                      name=f"kvbroker exchange cancel {command_id}")
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, call: grpc.aio.StreamStreamCall, command_id: int) -> None:
        cancel_id = next(self._ids)
        future: asyncio.Future[bpb.ExchangeResponse] = asyncio.get_running_loop().create_future()
        self._pending[cancel_id] = future
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                async with self._write_lock:
                    await call.write(bpb.ExchangeRequest(command_id=cancel_id,
                                                         cancel=bpb.ExchangeCancel(command_id=command_id)))
                self.cancels_sent += 1
                self.commands_sent += 1
                reply = await future
            # NOT_FOUND: the command ended as the cancel went out
            log.debug("command %d cancelled on %s: %s", command_id, self._target, reply.WhichOneof("reply"))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, StreamBroken,
                ExchangeUnsupported, TimeoutError) as exc:
            # the stream ended meanwhile (its end frees the command), or the broker did not answer in time
            log.debug("cancel of command %d on %s: %s: %s", command_id, self._target, type(exc).__name__, exc)
        finally:
            self._pending.pop(cancel_id, None)

    async def _send(self, message: bpb.ExchangeRequest, timeout: float) -> grpc.aio.StreamStreamCall:
        """Write `message` on the stream (opened first if none is); the stream it went on."""
        if self.supported is False:
            raise ExchangeUnsupported()
        call = self._call or await self._open(timeout)
        try:
            async with self._write_lock:
                await call.write(message)
            self.commands_sent += 1
            return call
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            # the stream ended under the write: the reader tells every caller why, this one included
            if self._reader is not None and not self._reader.done():
                await asyncio.wait([self._reader], timeout=1.0)
            if self.supported is False:
                raise ExchangeUnsupported() from None
            raise StreamBroken(f"the Exchange stream to {self._target} ended: {exc}") from None

    async def _open(self, timeout: float) -> grpc.aio.StreamStreamCall:
        """A new stream, once the broker has answered it: its initial metadata (the RPC is served), or
        UNIMPLEMENTED (it is not), before any command is written on it."""
        async with self._open_lock:
            if self.supported is False:
                raise ExchangeUnsupported()
            if self._call is None:
                call = self._stub.Exchange()
                try:
                    await asyncio.wait_for(call.initial_metadata(), timeout)
                    if call.done():  # answered with its status alone
                        code = await call.code()
                        if code is grpc.StatusCode.UNIMPLEMENTED:
                            self.supported = False
                            raise ExchangeUnsupported()
                        raise StreamBroken(f"no Exchange stream to {self._target}: {code.name}: "
                                           f"{await call.details()}")
                except grpc.aio.AioRpcError as exc:
                    raise StreamBroken(f"no Exchange stream to {self._target}: {from_rpc_error(exc)}") from None
                except TimeoutError:
                    call.cancel()
                    raise DeadlineExceeded(f"no Exchange stream to {self._target} within {timeout:.3g}s") from None
                except BaseException:
                    call.cancel()
                    raise
                self.supported = True
                self._call = call
                self._reader = asyncio.get_running_loop().create_task(self._read(call),
                                                                      name=f"kvbroker exchange {self._target}")
                self.streams_opened += 1
            return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        """Hand every reply to its caller until the stream ends; then fail whatever is in flight."""
        try:
            while (reply := await call.read()) is not grpc.aio.EOF:
                self.replies_read += 1
                self._waiters.hand(reply)
            error: BaseException = StreamBroken(f"the broker at {self._target} ended the Exchange stream")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                error = ExchangeUnsupported()
            else:
                error = StreamBroken(f"the Exchange stream to {self._target} broke: {from_rpc_error(exc)}")
        except asyncio.CancelledError:
            error = StreamBroken(f"the Exchange stream to {self._target} was closed")
        if self._call is call:
            self._call = None
        call.cancel()
        if self._pending or self._watches:
            log.warning("%s with %d command(s) and %d watch(es) in flight", error, len(self._pending),
                        len(self._watches))
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)
        for queue in list(self._watches.values()):
            queue.put_nowait(error)

    async def close(self) -> None:
        for task in list(self._cancels):
            task.cancel()
        await asyncio.gather(*self._cancels, return_exceptions=True)
        call, reader = self._call, self._reader
        self._call = self._reader = None
        if call is not None:
            call.cancel()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


class _Waiters:
    """Who waits for which reply on one Exchange: a command's future, a watch's queue (by command_id),
    and which watches a transfer with end_watches ends with its SUCCEEDED reply."""

    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future[bpb.ExchangeResponse]] = {}
        self.watches: dict[int, asyncio.Queue[bpb.ExchangeResponse | BaseException]] = {}
        self.watched: dict[int, tuple[str, str]] = {}  # watch command -> its (engine_id, request_id)
        self.enders: dict[int, tuple[str, str]] = {}  # transfer command with end_watches -> its request

    def hand(self, reply: bpb.ExchangeResponse) -> None:
        """One reply to its caller (a reply to no one in flight, e.g. after its caller left, is dropped)."""
        if (future := self.pending.pop(reply.command_id, None)) is not None:
            if reply.command_id in self.enders:
                self._end_watches(reply)
            if not future.done():
                future.set_result(reply)
        elif (queue := self.watches.get(reply.command_id)) is not None:
            queue.put_nowait(reply)

    def _end_watches(self, reply: bpb.ExchangeResponse) -> None:
        """A transfer with end_watches answered: a SUCCEEDED reply is the last message of this stream's
        watches of its request (the broker sends them none)."""
        key = self.enders.pop(reply.command_id)
        if reply.WhichOneof("reply") != "transfer" or reply.transfer.status.state != pb.TRANSFER_STATE_SUCCEEDED:
            return
        for command_id, watched in list(self.watched.items()):
            if watched == key and (queue := self.watches.get(command_id)) is not None:
                queue.put_nowait(bpb.ExchangeResponse(command_id=command_id,
                                                      watch=bpb.WatchTransferResponse(status=reply.transfer.status)))


def _ms(timeout: float) -> int:
    return min(max(1, round(timeout * 1000)), (1 << 32) - 1)


def _error(error: bpb.ExchangeError):
    code = status_code(error.code)
    return error_for_code(code)(error.message or code.name)
