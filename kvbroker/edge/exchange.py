"""The Exchange stream (BrokerService.Exchange): one long-lived command channel per inference server.

`Exchanges.serve` is what BrokerServicer.Exchange calls for each stream; `Exchanges.close` is the
server's at shutdown. One `_Stream` per stream:
- `_read` takes each command off the wire and runs it as a task the stream owns (OwnedTasks), at
  most max_exchange_commands at once (more are refused RESOURCE_EXHAUSTED naming the setting);
- `_command` makes the very Broker call the command's unary RPC makes (Transfer, ExpectTransfer,
  WatchTransfer), converted by edge/convert.py the same way, its failure the reply's code and
  message as edge/codes.py maps it for the unary RPC: no rule is checked here;
- a message admission.py refused (too large, too many page ids) arrives as its Refusal, answered
  under its command_id as the unary RPC would be refused;
- each command writes its own replies, one write at a time (gRPC takes no more), and none before the
  stream's initial metadata has been sent; a reply that could not be written ends the stream;
- the requests an ExpectTransfer or a Transfer on it created or fed are *carried*: when the stream
  ends (the client went, broke or half-closed, or the broker stopped: then after its commands wrote
  their last replies, up to CLOSE_WAIT_S, the drain having ended every request), `_end` lets its expects and
  transfers finish (each has its own bound), stops its watches, and fails every carried request
  that has not ended through Broker.cancel, as CancelTransfer would (CANCELLED; the peer is told).
  Without that a request fed by a client that went would wait for its grant's expiry, as it does
  on the unary path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.tasks import OwnedTasks
from kvbroker.edge import convert
from kvbroker.edge.admission import Refusal
from kvbroker.edge.codes import details, failure
from kvbroker.flows.broker import Broker
from kvbroker.flows.transfers import TransferStatus
from kvbroker_client.v1 import broker_service_pb2 as bpb

log = logging.getLogger(__name__)

MAX_PING_BYTES = 64
CLOSE_WAIT_S = 2.0
END_REASON = "the Exchange stream that carried the request ended before the request did"


class Exchanges:
    """Every Exchange stream of one broker, and the ends of the streams that are over."""

    def __init__(self, broker: Broker, max_commands: int, settle_s: float) -> None:
        self._broker = broker
        self._max_commands = max_commands
        self._settle_s = settle_s  # how long a stream's end waits for its expects and transfers
        self._ends = OwnedTasks()  # a stream's end outlives its handler, which gRPC cancels

    async def serve(self, requests: AsyncIterator[bpb.ExchangeRequest], context) -> None:
        """Run one stream until it ends; its replies written on `context` (the handler's)."""
        await _Stream(self._broker, self._max_commands, self._settle_s, self._ends, context).run(requests)

    async def close(self) -> None:
        """At shutdown, after the drain: the ends still running find their requests ended already."""
        await self._ends.wait(CLOSE_WAIT_S)
        await self._ends.cancel(self._settle_s)


class _Stream:
    def __init__(self, broker: Broker, max_commands: int, settle_s: float, ends: OwnedTasks, context) -> None:
        self._broker = broker
        self._context = context
        self._max_commands = max_commands
        self._settle_s = settle_s
        self._ends = ends
        self._commands = OwnedTasks()
        self._in_flight: dict[int, asyncio.Task] = {}
        self._watches: set[asyncio.Task] = set()
        self._carried: dict[tuple[str, str], None] = {}  # (engine_id, request_id), insertion-ordered
        self._pruned_at = 0
        self._writing = asyncio.Lock()  # grpc takes one write at a time; each command writes its own replies
        # every command read has ended after the client's last, a reply was lost, or the broker stops
        self._over = asyncio.Event()
        self._read_all = False

    async def run(self, requests: AsyncIterator[bpb.ExchangeRequest]) -> None:
        stopping = asyncio.ensure_future(self._broker.stopping.wait())
        stopping.add_done_callback(lambda _: self._over.set())
        reader: asyncio.Task | None = None
        try:
            # The client learns at once that the RPC is served, and writes its first command then. Only
            # after this returns are commands read: grpc marks the metadata sent when the send completes,
            # and a reply written before that carries the metadata again, a batch grpc core refuses (the
            # reply lost, its client waiting out the command's deadline).
            await self._context.send_initial_metadata(())
            reader = asyncio.get_running_loop().create_task(self._read(requests), name="exchange reader")
            await self._over.wait()
            if self._broker.stopping.is_set():
                # The drain ended every request before it set `stopping`: each watch still has its
                # terminal status to write, which _end's cancel would cut off (the client then sees
                # the stream end instead of "broker shut down").
                await self._commands.wait(CLOSE_WAIT_S)
        finally:
            if reader is not None:
                reader.cancel()
            stopping.cancel()
            self._ends.spawn(self._end(), "exchange end")

    async def _read(self, requests: AsyncIterator[bpb.ExchangeRequest | Refusal]) -> None:
        async for request in requests:
            if isinstance(request, Refusal):  # admission.py refused it, as it refuses the unary RPC
                assert request.command_id is not None
                await self._write(bpb.ExchangeResponse(command_id=request.command_id, error=bpb.ExchangeError(
                    code=request.code.value[0], message=details(request.message))))
                continue
            command_id = request.command_id
            if command_id in self._in_flight:
                await self._refuse(command_id, BrokerError(Code.INVALID_ARGUMENT, f"command_id: {command_id} is in "
                                                     "flight on this stream already"))
            elif len(self._in_flight) >= self._max_commands:
                await self._refuse(command_id, BrokerError(
                    Code.RESOURCE_EXHAUSTED, f"command_id {command_id}: {len(self._in_flight)} commands are in "
                    f"flight on this stream, its limit (max_exchange_commands={self._max_commands})"))
            else:
                task = self._commands.spawn(self._command(request), f"exchange command {command_id}")
                self._in_flight[command_id] = task
                task.add_done_callback(lambda _, cid=command_id: self._done(cid))
                if request.WhichOneof("command") == "watch":
                    self._watches.add(task)
        self._read_all = True
        if not self._in_flight:
            self._over.set()

    def _done(self, command_id: int) -> None:
        """The command's slot is free (idempotent); once every command read has ended, so is the stream."""
        task = self._in_flight.pop(command_id, None)
        if task is None:
            return
        self._watches.discard(task)
        if self._read_all and not self._in_flight:
            self._over.set()

    async def _write(self, reply: bpb.ExchangeResponse) -> None:
        """One reply, written by the task that has it (no hop through a writer task). A reply that could
        not be written ends the stream: its client learns that (StreamBroken) instead of waiting out
        the command's deadline, and _end fails what the stream carried."""
        async with self._writing:
            try:
                await self._context.write(reply)
            except Exception as exc:
                gone = self._context.done()  # the client went or the call ended: _end takes over
                log.log(logging.DEBUG if gone else logging.WARNING, "exchange reply %d not written, the stream "
                        "ends: %s: %s", reply.command_id, type(exc).__name__, exc)
                self._over.set()

    async def _last(self, reply: bpb.ExchangeResponse) -> None:
        """A command's last reply, its slot freed before it is written: a client that saw the reply
        finds the slot free."""
        in_flight = self._in_flight.pop(reply.command_id, None)
        try:
            await self._write(reply)
        finally:
            if in_flight is not None:
                self._in_flight[reply.command_id] = in_flight  # _done, at the task's end, frees it for good
                self._done(reply.command_id)

    async def _refuse(self, command_id: int, exc: BaseException) -> None:
        code, message = failure(exc)
        await self._last(bpb.ExchangeResponse(command_id=command_id,
                                              error=bpb.ExchangeError(code=code.value[0], message=message)))

    async def _command(self, request: bpb.ExchangeRequest) -> None:
        command_id, kind = request.command_id, request.WhichOneof("command")
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        try:
            if kind == "transfer":
                status = await self._transfer(request.transfer, timeout)
                reply = bpb.ExchangeResponse(command_id=command_id,
                                             transfer=bpb.TransferResponse(status=convert.status_out(status)))
            elif kind == "expect":
                status = await self._expect(request.expect, timeout)
                reply = bpb.ExchangeResponse(command_id=command_id,
                                             expect=bpb.ExpectTransferResponse(status=convert.status_out(status)))
            elif kind == "watch":
                await self._watch(command_id, request.watch)
                return
            elif kind == "ping":
                if len(request.ping.payload) > MAX_PING_BYTES:
                    raise BrokerError(Code.INVALID_ARGUMENT, f"ping.payload: {len(request.ping.payload)} bytes "
                                                             f"exceed {MAX_PING_BYTES}")
                reply = bpb.ExchangeResponse(command_id=command_id, pong=request.ping)
            else:
                raise BrokerError(Code.INVALID_ARGUMENT, "command: none set (transfer, expect, watch or ping)")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._refuse(command_id, exc)
            return
        await self._last(reply)

    async def _transfer(self, request: bpb.TransferRequest, timeout: float | None) -> TransferStatus:
        status = await self._broker.transfer(request.engine_id, lambda: convert.transfer_command_in(request),
                                             timeout)
        self._carry(status)
        return status

    async def _expect(self, request: bpb.ExpectTransferRequest, timeout: float | None) -> TransferStatus:
        try:
            async with asyncio.timeout(timeout):
                status = await self._broker.expect_transfer(request.engine_id,
                                                            lambda: convert.grant_command_in(request))
        except TimeoutError:
            raise BrokerError(Code.DEADLINE_EXCEEDED, f"timeout_ms: the command's deadline of "
                                                      f"{timeout * 1000:.0f} ms passed") from None  # type: ignore[operator]
        self._carry(status)
        return status

    async def _watch(self, command_id: int, request: bpb.WatchTransferRequest) -> None:
        updates = await self._broker.watch(request.engine_id, request.request_id, states_only=request.states_only,
                                           terminal_only=request.terminal_only,
                                           offer_wait_s=request.offer_wait_ms / 1000)
        async with contextlib.aclosing(updates):
            async for status in updates:
                reply = bpb.ExchangeResponse(command_id=command_id,
                                             watch=bpb.WatchTransferResponse(status=convert.status_out(status)))
                if status.state.terminal:
                    self._carried.pop((status.engine_id, status.request_id), None)
                    await self._last(reply)
                else:
                    await self._write(reply)

    def _carry(self, status: TransferStatus) -> None:
        key = (status.engine_id, status.request_id)
        if status.state.terminal:
            self._carried.pop(key, None)
            return
        self._carried[key] = None
        if len(self._carried) > max(2 * self._pruned_at, 1024):
            self._ends.spawn(self._prune(), "exchange prune")

    async def _prune(self) -> None:
        """Forget the carried requests that ended without a watch on this stream telling it."""
        self._pruned_at = len(self._carried)
        for key in list(self._carried):
            if await self._state(*key) is None:
                self._carried.pop(key, None)
        self._pruned_at = len(self._carried)

    async def _state(self, engine_id: str, request_id: str) -> TransferStatus | None:
        """The request's status while it is live; None once it ended or is gone."""
        try:
            updates = await self._broker.watch(engine_id, request_id)
        except BrokerError:
            return None
        async with contextlib.aclosing(updates):
            status = await anext(updates)
        return None if status.state.terminal else status

    async def _end(self) -> None:
        for task in list(self._watches):
            task.cancel()
        await self._commands.wait(self._settle_s)
        await self._commands.cancel(self._settle_s)
        for engine_id, request_id in list(self._carried):
            if await self._state(engine_id, request_id) is None:
                continue
            try:
                status = await self._broker.cancel(engine_id, request_id, END_REASON)
            except BrokerError:
                continue  # gone meanwhile (its engine unregistered, its record trimmed)
            log.info("exchange stream ended: request %s on engine %s %s", request_id, engine_id,
                     status.state.name.lower())
