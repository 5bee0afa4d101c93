"""The Exchange stream (BrokerService.Exchange): one long-lived command channel per inference server.

`Exchanges.serve` is what BrokerServicer.Exchange calls for each stream; `Exchanges.close` is the
server's at shutdown. One `_Stream` per stream, whose commands are exchange_commands.py's:
- `_read` takes each command off the wire once the stream's Outbox (outbox.py) has room: a client
  that does not read its replies has no more commands read until it does, and is ended
  RESOURCE_EXHAUSTED (stream_stall_s) if it stays so;
- `_take` runs each as a task of `Commands`, at most max_exchange_commands at once (more are refused
  RESOURCE_EXHAUSTED naming the setting), each the Broker call of its unary RPC; a command_id in
  flight already is refused INVALID_ARGUMENT;
- a cancel (`_cancel`) ends the command it names (Commands.stop): its last reply is CANCELLED, then
  the cancel is answered; one naming no command in flight is NOT_FOUND, one naming 0 or itself
  INVALID_ARGUMENT. A cancel takes no slot: the reader answers it;
- a message admission.py refused (too large, too many page ids) arrives as its Refusal, answered
  under its command_id as the unary RPC would be refused;
- every reply goes through the Outbox, whose writer alone writes, and none before the stream's
  initial metadata has been sent; a reply that could not be written ends the stream;
- the requests an ExpectTransfer or a Transfer on it created or fed are *carried* (`Carried`): when
  the stream ends (the client went, broke, half-closed or stalled, or the broker stopped: then after
  its commands wrote their last replies, up to CLOSE_WAIT_S, the drain having ended every request),
  `_end` stops its commands, lets its Broker calls finish (each has its own bound), and fails every
  carried request that has not ended through Broker.cancel, as CancelTransfer would (CANCELLED; the
  peer is told). Without that a request fed by a client that went would wait for its grant's
  expiry, as it does on the unary path.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.tasks import OwnedTasks
from kvbroker.edge.codes import details, failure
from kvbroker.edge.exchange_commands import END_REASON, Carried, Commands, ExchangeObserver, error_reply
from kvbroker.edge.outbox import Ended, Outbox, StreamBounds, end_stalled, gone
from kvbroker.edge.request_limits import Refusal
from kvbroker.flows.broker import Broker
from kvbroker_client.v1 import broker_service_pb2 as bpb

CLOSE_WAIT_S = 2.0
__all__ = ["END_REASON", "Exchanges"]


class Exchanges:
    """Every Exchange stream of one broker, and the ends of the streams that are over."""

    def __init__(self, broker: Broker, max_commands: int, settle_s: float, bounds: StreamBounds | None = None,
                 observer: ExchangeObserver | None = None) -> None:
        self.broker = broker
        self.max_commands = max_commands
        self.settle_s = settle_s  # how long a stream's end waits for its Broker calls
        self.bounds = bounds or StreamBounds()
        self.observer = observer
        self.ends = OwnedTasks()  # a stream's end outlives its handler, which gRPC cancels

    async def serve(self, requests: AsyncIterator[bpb.ExchangeRequest], context) -> None:
        """Run one stream until it ends; its replies written on `context` (the handler's)."""
        await _Stream(self, context).run(requests)

    async def close(self) -> None:
        """At shutdown, after the drain: the ends still running find their requests ended already."""
        await self.ends.wait(CLOSE_WAIT_S)
        await self.ends.cancel(self.settle_s)


class _Stream:
    def __init__(self, exchanges: Exchanges, context) -> None:
        self._x = exchanges
        self._broker = exchanges.broker
        self._context = context
        self._outbox = Outbox(context.write, exchanges.bounds, "Exchange", exchanges.observer)
        self._carried = Carried(exchanges.broker, exchanges.ends)
        self._commands = Commands(exchanges.broker, self._outbox, self._carried, exchanges.observer, self._freed)
        # every command read has ended after the client's last, the outbox ended, or the broker stops
        self._over = asyncio.Event()
        self._read_all = False
        self._aborted: grpc.aio.AbortError | None = None  # raised by the handler, as grpc wants its own abort

    async def run(self, requests: AsyncIterator[bpb.ExchangeRequest]) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in (self._broker.stopping, self._outbox.ended)]
        for wait in waits:
            wait.add_done_callback(lambda _: self._over.set())
        reader: asyncio.Task | None = None
        try:
            # The client learns at once that the RPC is served, and writes its first command then. Only
            # after this returns are commands read: grpc marks the metadata sent when the send completes,
            # and a reply written before that carries the metadata again, a batch grpc core refuses (the
            # reply lost, its client waiting out the command's deadline).
            await self._context.send_initial_metadata(())
            self._outbox.start()
            reader = asyncio.get_running_loop().create_task(self._read(requests), name="exchange reader")
            await self._over.wait()
            if self._broker.stopping.is_set():
                # The drain ended every request before it set `stopping`: each watch still has its
                # terminal status to write, which _end's cancel would cut off (the client then sees
                # the stream end instead of "broker shut down").
                await self._commands.wait(CLOSE_WAIT_S)
            if self._aborted is None:
                await self._outbox.flush(self._x.bounds.stall_s)  # the last replies go out before the call ends
        finally:
            if reader is not None:
                reader.cancel()
            for wait in waits:
                wait.cancel()
            self._x.ends.spawn(self._end(), "exchange end")
        if self._aborted is not None:
            raise self._aborted
        if self._outbox.stalled is not None:
            end_stalled(self._context, self._outbox.stalled)
            await self._outbox.settle(self._x.bounds.stall_s)  # as Outbox.close: the write under way, or the end
        elif self._outbox.lost:
            await gone(self._context)

    async def _read(self, requests: AsyncIterator[bpb.ExchangeRequest | Refusal]) -> None:
        iterator = aiter(requests)
        try:
            while True:
                await self._outbox.room()  # a client that does not read its replies has no command read
                try:
                    request = await anext(iterator)
                except StopAsyncIteration:
                    break
                if isinstance(request, Refusal):  # admission.py refused it, as it refuses the unary RPC
                    assert request.command_id is not None
                    await self._outbox.put(error_reply(request.command_id, request.code, details(request.message)))
                else:
                    await self._take(request)
        except Ended:
            return
        except grpc.aio.AbortError as exc:  # admission.py ended the call: a message without a command_id
            self._aborted = exc
            self._over.set()
            return
        self._read_all = True
        self._freed()

    def _freed(self) -> None:
        """A command's slot came free: once every command read has ended, so is the stream."""
        if self._read_all and not self._commands.in_flight:
            self._over.set()

    async def _take(self, request: bpb.ExchangeRequest) -> None:
        command_id, kind = request.command_id, request.WhichOneof("command")
        if command_id in self._commands.in_flight:
            await self._refuse(command_id, BrokerError(Code.INVALID_ARGUMENT, f"command_id: {command_id} is in "
                                                       "flight on this stream already"))
        elif kind == "cancel":
            await self._cancel(command_id, request.cancel.command_id)
        elif self._commands.slots >= self._x.max_commands:
            orphans = self._commands.slots - len(self._commands.in_flight)
            ending = f", {orphans} of them cancelled and ending" if orphans else ""
            await self._refuse(command_id, BrokerError(
                Code.RESOURCE_EXHAUSTED, f"command_id {command_id}: {self._commands.slots} commands are in flight "
                f"on this stream{ending}, its limit (max_exchange_commands={self._x.max_commands})"))
        else:
            self._commands.start(request)

    async def _cancel(self, command_id: int, target: int) -> None:
        """End command `target` with CANCELLED, then answer the cancel; or refuse it, under its own id."""
        if target == 0:
            error = BrokerError(Code.INVALID_ARGUMENT, "cancel.command_id: 0 names no command (command ids are "
                                                       "nonzero)")
        elif target == command_id:
            error = BrokerError(Code.INVALID_ARGUMENT, f"cancel.command_id: {target} is this cancel's own command_id")
        elif not await self._commands.stop(target, self._x.settle_s):
            error = BrokerError(Code.NOT_FOUND, f"cancel.command_id: no command {target} is in flight on this stream "
                                                "(it ended, was cancelled, or never began)")
        else:
            await self._outbox.put(error_reply(target, Code.CANCELLED, f"command {target}: cancelled by the client "
                                                                       f"(cancel {command_id})"))
            await self._outbox.put(bpb.ExchangeResponse(command_id=command_id,
                                                        cancelled=bpb.ExchangeCancel(command_id=target)))
            return
        await self._refuse(command_id, error)

    async def _refuse(self, command_id: int, error: BrokerError) -> None:
        code, message = failure(error)
        await self._outbox.put(error_reply(command_id, code, message))

    async def _end(self) -> None:
        self._outbox.stop()  # the call is over: nothing more is written, and no put waits
        await self._commands.end(self._x.settle_s)
        await self._carried.end()
        await self._outbox.close()
