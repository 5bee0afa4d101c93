"""The commands in flight on one Exchange stream, which exchange.py's `_Stream` reads and owns:
- `Commands.start` runs a command as a task of its own, holding a slot of max_exchange_commands;
  `_run` makes the very Broker call the command's unary RPC makes (Transfer, ExpectTransfer,
  WatchTransfer), converted by edge/convert.py the same way, its failure its last reply's code and
  message as edge/codes.py maps it for the unary RPC: no rule is checked here. A watch ends with its
  request's terminal status, or at the command's deadline (timeout_ms: DEADLINE_EXCEEDED); an
  expect_watch is the ExpectTransfer, its reply, then a terminal-only watch of the grant, under one
  deadline;
- a transfer with end_watches whose reply is SUCCEEDED ends the stream's watches of its request
  (`_end_watches`) before that reply is queued: they send nothing more, the reply is their end. A
  watch that sees its request SUCCEEDED while such a transfer is in flight waits for that transfer
  first, so that the request's end goes out once;
- a command's last reply frees its slot as it is queued (`_last`): a client that saw it finds the
  slot free;
- `stop` ends one command for a cancel. A transfer's or expect's Broker call is not cut by it (as a
  unary call's is not when its client goes, `_call`): it runs on, holding the slot until it ends;
- `end` stops them all when the stream ends: its watches at once, its Broker calls each within its
  own bound;
- `Carried`: the requests the stream's transfers and expects created or fed, which its end fails
  (CANCELLED, END_REASON) unless they ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import grpc

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.model import TransferState
from kvbroker.core.tasks import OwnedTasks
from kvbroker.edge import convert
from kvbroker.edge.codes import failure, status_code
from kvbroker.edge.outbox import Ended, Outbox, StreamObserver
from kvbroker.flows.broker import Broker
from kvbroker.flows.transfers import TransferStatus
from kvbroker_client.codes import code_number
from kvbroker_client.v1 import broker_service_pb2 as bpb

log = logging.getLogger(__name__)

MAX_PING_BYTES = 64
END_REASON = "the Exchange stream that carried the request ended before the request did"


class ExchangeObserver(StreamObserver, Protocol):
    def commands_held(self, delta: int) -> None: ...  # command slots taken (+) or freed (-), all streams


def error_reply(command_id: int, code: grpc.StatusCode | Code, message: str) -> bpb.ExchangeResponse:
    code = status_code(code) if isinstance(code, Code) else code
    return bpb.ExchangeResponse(command_id=command_id, error=bpb.ExchangeError(code=code_number(code), message=message))


def _ms(timeout: float | None) -> str:
    return f"{(timeout or 0) * 1000:.0f}"


class Commands:
    def __init__(self, broker: Broker, outbox: Outbox, carried: Carried, observer: ExchangeObserver | None,
                 freed: Callable[[], None]) -> None:
        self._broker = broker
        self._outbox = outbox
        self._carried = carried
        self._observer = observer
        self._freed = freed  # told each time a command's slot comes free
        self._tasks = OwnedTasks()
        self._calls = OwnedTasks()  # the Broker calls of transfers and expects: a cancel does not cut them
        self.in_flight: dict[int, asyncio.Task] = {}
        self._orphans: set[asyncio.Task] = set()  # calls whose command was cancelled: each holds a slot still
        self._watches: set[asyncio.Task] = set()
        self._watched: dict[int, tuple[str, str]] = {}  # watch command -> its (engine_id, request_id)
        self._enders: dict[tuple[str, str], set[asyncio.Task]] = {}  # transfers in flight with end_watches
        self._told = 0  # slots the observer was told this stream holds

    @property
    def slots(self) -> int:
        return len(self.in_flight) + len(self._orphans)

    def _tell(self) -> None:
        if self._observer is not None and self.slots != self._told:
            self._observer.commands_held(self.slots - self._told)
        self._told = self.slots

    def start(self, request: bpb.ExchangeRequest) -> None:
        command_id = request.command_id
        task = self._tasks.spawn(self._run(request), f"exchange command {command_id}")
        self.in_flight[command_id] = task
        task.add_done_callback(lambda _: self._done(command_id, task))
        kind = request.WhichOneof("command")
        if kind in ("watch", "expect_watch"):
            self._watches.add(task)
        elif kind == "transfer" and request.transfer.end_watches:
            key = (request.transfer.engine_id, request.transfer.request_id)
            self._enders.setdefault(key, set()).add(task)
            task.add_done_callback(lambda _: self._ender_done(key, task))
        self._tell()

    def _ender_done(self, key: tuple[str, str], task: asyncio.Task) -> None:
        enders = self._enders.get(key)
        if enders is not None:
            enders.discard(task)
            if not enders:
                del self._enders[key]

    async def stop(self, command_id: int, wait_s: float) -> bool:
        """End command `command_id` for a cancel, its slot freed; False when it is not in flight."""
        task = self.in_flight.get(command_id)
        if task is None or task.done():
            return False
        task.cancel()
        # A cancelled command stops at its next await (a Broker call it made runs on, _call); the cancel
        # writes its last reply, not the command.
        if not (await asyncio.wait([task], timeout=wait_s))[0]:
            log.warning("exchange command %d did not stop within %.0fs of its cancel", command_id, wait_s)
        self._done(command_id, task)
        return True

    async def wait(self, timeout: float) -> None:
        await self._tasks.wait(timeout)

    def _done(self, command_id: int, task: asyncio.Task) -> None:
        """The command's slot is free (idempotent)."""
        if self.in_flight.get(command_id) is not task:
            return
        del self.in_flight[command_id]
        self._watches.discard(task)
        self._watched.pop(command_id, None)
        self._tell()
        self._freed()

    async def _last(self, reply: bpb.ExchangeResponse) -> None:
        """A command's last reply, queued; its slot freed at once, before the reply is written."""
        await self._outbox.put(reply)
        task = asyncio.current_task()
        if task is not None:
            self._done(reply.command_id, task)

    async def _run(self, request: bpb.ExchangeRequest) -> None:
        command_id, kind = request.command_id, request.WhichOneof("command")
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        try:
            if kind == "transfer":
                status = await self._call(self._broker.transfer(
                    request.transfer.engine_id, lambda: convert.transfer_command_in(request.transfer), timeout))
                if request.transfer.end_watches and status.state is TransferState.SUCCEEDED:
                    self._end_watches((request.transfer.engine_id, request.transfer.request_id))
                reply = bpb.ExchangeResponse(command_id=command_id,
                                             transfer=bpb.TransferResponse(status=convert.status_out(status)))
            elif kind == "expect":
                status = await self._call(self._expect(request.expect, timeout))
                reply = bpb.ExchangeResponse(command_id=command_id,
                                             expect=bpb.ExpectTransferResponse(status=convert.status_out(status)))
            elif kind == "expect_watch":
                await self._expect_watch(command_id, request.expect_watch, timeout)
                return
            elif kind == "watch":
                await self._watch(command_id, request.watch, timeout)
                return
            elif kind == "ping":
                if len(request.ping.payload) > MAX_PING_BYTES:
                    raise BrokerError(Code.INVALID_ARGUMENT, f"ping.payload: {len(request.ping.payload)} bytes "
                                                             f"exceed {MAX_PING_BYTES}")
                reply = bpb.ExchangeResponse(command_id=command_id, pong=request.ping)
            else:
                raise BrokerError(Code.INVALID_ARGUMENT, "command: none set (transfer, expect, expect_watch, watch, "
                                                         "ping or cancel)")
            await self._last(reply)
        except asyncio.CancelledError:
            raise  # by its cancel, which answers it, or by the stream's end
        except Ended:
            return  # the stream is over: nothing more is written on it
        except BaseException as exc:
            code, message = failure(exc)
            with contextlib.suppress(Ended):
                await self._last(error_reply(command_id, code, message))

    async def _call(self, call: Coroutine[Any, Any, TransferStatus]) -> TransferStatus:
        """A Broker call that a cancel of its command does not cut: the request it creates or feeds is
        carried however it ends, and its slot stays taken until it does."""
        task = self._calls.spawn(call, "exchange call")
        task.add_done_callback(self._carried.carry_result)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._orphans.add(task)
                task.add_done_callback(self._orphan_done)
            raise

    def _orphan_done(self, task: asyncio.Task) -> None:
        self._orphans.discard(task)
        self._tell()

    async def _expect(self, request: bpb.ExpectTransferRequest, timeout: float | None) -> TransferStatus:
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await self._broker.expect_transfer(request.engine_id, lambda: convert.grant_command_in(request))
        except TimeoutError:
            if not deadline.expired():
                raise
            raise BrokerError(Code.DEADLINE_EXCEEDED, f"timeout_ms: the command's deadline of "
                                                      f"{_ms(timeout)} ms passed") from None

    async def _expect_watch(self, command_id: int, request: bpb.ExpectTransferRequest, timeout: float | None) -> None:
        """The grant, its reply, then its end as a terminal-only watch; `timeout` bounds the whole command."""
        loop = asyncio.get_running_loop()
        at = None if timeout is None else loop.time() + timeout
        status = await self._call(self._expect(request, timeout))
        await self._outbox.put(bpb.ExchangeResponse(command_id=command_id, expect=bpb.ExpectTransferResponse(
            status=convert.status_out(status))))
        watch = bpb.WatchTransferRequest(engine_id=request.engine_id, request_id=request.request_id, terminal_only=True)
        await self._watch(command_id, watch, None if at is None else max(0.0, at - loop.time()))

    def _end_watches(self, key: tuple[str, str]) -> None:
        """A transfer's SUCCEEDED reply is the end of the stream's watches of its request: each is stopped
        and its slot freed with no message (the client hands it the transfer's reply)."""
        for command_id, watched in list(self._watched.items()):
            task = self.in_flight.get(command_id)
            if watched == key and task is not None and task is not asyncio.current_task():
                task.cancel()
                self._done(command_id, task)

    async def _watch(self, command_id: int, request: bpb.WatchTransferRequest, timeout: float | None) -> None:
        deadline = asyncio.timeout(timeout)
        key = (request.engine_id, request.request_id)
        self._watched[command_id] = key
        try:
            async with deadline:
                updates = await self._broker.watch(request.engine_id, request.request_id,
                                                   states_only=request.states_only,
                                                   terminal_only=request.terminal_only,
                                                   offer_wait_s=request.offer_wait_ms / 1000)
                async with contextlib.aclosing(updates):
                    async for status in updates:
                        reply = bpb.ExchangeResponse(command_id=command_id, watch=bpb.WatchTransferResponse(
                            status=convert.status_out(status)))
                        if status.state is TransferState.SUCCEEDED and self._enders.get(key):
                            # a transfer in flight may end this watch with its reply (end_watches): if
                            # it does, this task is cancelled in this wait, and sends nothing
                            await asyncio.wait(list(self._enders[key]))
                        if status.state.terminal:
                            self._carried.forget(status)
                            await self._last(reply)
                        else:
                            await self._outbox.put(reply)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise BrokerError(Code.DEADLINE_EXCEEDED, f"timeout_ms: the watch's deadline of {_ms(timeout)} ms passed "
                                                      f"before request {request.request_id[:128]!r} ended") from None

    async def end(self, settle_s: float) -> None:
        """At the stream's end: its watches stopped, its other commands and their Broker calls let end
        (each within its own bound, up to `settle_s`), then cut; every slot freed."""
        for task in list(self._watches):
            task.cancel()
        await self._tasks.wait(settle_s)
        await self._tasks.cancel(settle_s)
        await self._calls.wait(settle_s)
        await self._calls.cancel(settle_s)
        self.in_flight.clear()
        self._orphans.clear()
        self._tell()


class Carried:
    """The requests a stream's transfers and expects created or fed, insertion-ordered, until they end."""

    def __init__(self, broker: Broker, tasks: OwnedTasks) -> None:
        self._broker = broker
        self._tasks = tasks
        self._keys: dict[tuple[str, str], None] = {}  # (engine_id, request_id)
        self._pruned_at = 0

    def carry_result(self, call: asyncio.Task) -> None:
        """A Broker call's done callback: its request is carried while it has not ended."""
        if not call.cancelled() and call.exception() is None:
            self.carry(call.result())

    def carry(self, status: TransferStatus) -> None:
        key = (status.engine_id, status.request_id)
        if status.state.terminal:
            self._keys.pop(key, None)
            return
        self._keys[key] = None
        if len(self._keys) > max(2 * self._pruned_at, 1024):
            self._tasks.spawn(self._prune(), "exchange prune")

    def forget(self, status: TransferStatus) -> None:
        self._keys.pop((status.engine_id, status.request_id), None)

    async def _prune(self) -> None:
        """Forget the carried requests that ended without a watch on this stream telling it."""
        self._pruned_at = len(self._keys)
        for key in list(self._keys):
            if await self._state(*key) is None:
                self._keys.pop(key, None)
        self._pruned_at = len(self._keys)

    async def _state(self, engine_id: str, request_id: str) -> TransferStatus | None:
        """The request's status while it is live; None once it ended or is gone."""
        try:
            updates = await self._broker.watch(engine_id, request_id)
        except BrokerError:
            return None
        async with contextlib.aclosing(updates):
            status = await anext(updates)
        return None if status.state.terminal else status

    async def end(self) -> None:
        """Fail every carried request that has not ended, as CancelTransfer would."""
        for engine_id, request_id in list(self._keys):
            if await self._state(engine_id, request_id) is None:
                continue
            try:
                status = await self._broker.cancel(engine_id, request_id, END_REASON)
            except BrokerError:
                continue  # gone meanwhile (its engine unregistered, its record trimmed)
            log.info("exchange stream ended: request %s on engine %s %s", request_id, engine_id,
                     status.state.name.lower())
        self._keys.clear()
