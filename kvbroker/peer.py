"""Broker to broker: the PeerService servicer (the receiving side) and PeerClients (the sending side).

PeerClients caches one channel per peer address and one handshake per (address, engine); a new
epoch or registry generation seen in a claim, or a transport failure, makes the next use refresh.
Each cached handshake holds one `connect` of the backend, given back with `disconnect` when a
refresh replaces it or the peer answers with a new epoch. A transport failure only parks it until
the next handshake with that peer has connected (a peer of the same epoch keeps its engine-side
state, and a transfer that still holds the old handshake can still write); close gives back all.

Epochs are opaque: a broker's epoch differs on every start but is not ordered (it mixes the pid
into the clock, and clocks step), so handshake answers are ordered by when they were sent. An
answer with another epoch than the newest applied, to a handshake sent before that one, comes
from the process the peer has since replaced: it is given back and the handshake is sent again.

Idle peers: an address not used for `idle_s` (no handshake, claim or completion notice through
it, no handshake served from the cache, no write through one of its handles) is forgotten: its
handshakes and parked handles are given back, its channel closed, its record dropped. A replaced
pod's old address is never dialed again, so nothing else would ever let go of it. A sweeper task,
started with the first address used and ending when none is left (close cancels it), sleeps until
the earliest address falls due; an address with a call or a write running (Backend.writing) is
not due. A transfer uses its address from the handshake to the completion notice with no await
in between where it holds none of these, so the sweeper never takes a peer from under it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvbroker import convert
from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.broker import Broker, ClaimResult, PeerSession
from kvbroker.edge import from_rpc_error, translate_errors
from kvbroker.errors import BrokerError, Code
from kvbroker.metrics import Metrics
from kvbroker.model import ComponentKind, State
from kvbroker.transfers import Grant, TransferStatus
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc

log = logging.getLogger(__name__)

_TLS_FAILURE = re.compile(r"ssl|tls|handshake|certificate", re.IGNORECASE)
CLOSE_WAIT_S = 10.0  # how long close waits for channels to close and the backend to take peers back


class PeerServicer(ppb_grpc.PeerServiceServicer):
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @translate_errors
    async def Handshake(self, request: ppb.HandshakeRequest, context) -> ppb.HandshakeResponse:
        backend = self._broker.backend
        if request.backend != backend.name:
            raise BrokerError(Code.FAILED_PRECONDITION,
                              f"backend: caller uses {request.backend!r}, this broker uses {backend.name!r}")
        engine = self._broker.handshake_view(request.engine_id)
        return ppb.HandshakeResponse(
            broker_id=self._broker.broker_id, epoch=self._broker.epoch, generation=engine.generation,
            backend=backend.name, backend_metadata=await backend.metadata(),
            engine=convert.engine_layout_out(engine.layout),
        )

    @translate_errors
    async def ClaimGrant(self, request: ppb.ClaimGrantRequest, context) -> ppb.ClaimGrantResponse:
        grant, generation = self._broker.claim(
            request.engine_id, request.request_id, convert.components_in(request.components),
            convert.page_ids_in(request.dst_page_ids), claimant=request.broker_id,
        )
        return ppb.ClaimGrantResponse(
            dst_page_ids=grant.dst_page_ids.tolist(), epoch=self._broker.epoch, generation=generation,
            claim_token=grant.claim_token, remaining_ms=int(grant.remaining_s * 1000),
        )

    @translate_errors
    async def CompleteTransfer(self, request: ppb.CompleteTransferRequest, context) -> ppb.CompleteTransferResponse:
        state = self._broker.complete(
            request.engine_id, request.request_id, request.claim_token, request.broker_id,
            succeeded=request.succeeded, code=request.code, reason=request.reason, pages=request.pages,
            runs=request.runs, nbytes=request.bytes, truncated=request.truncated_pages,
        )
        return ppb.CompleteTransferResponse(state=int(state))


@dataclass
class PeerRecord:
    address: str
    broker_id: str = ""
    epoch: int = 0
    handshakes: int = 0
    sent: int = 0  # send order of the newest handshake whose answer was applied


class PeerClients:
    """The PeerLink of a Broker: handshakes, claims and completion notices over gRPC."""

    def __init__(self, broker_id: str, epoch: int, backend: Backend, *, idle_s: float,
                 channel_options: Sequence[tuple[str, object]] = (),
                 credentials: grpc.ChannelCredentials | None = None, metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        self._broker_id = broker_id
        self._epoch = epoch
        self._backend = backend
        self._idle_s = idle_s
        self._options = list(channel_options)
        self._credentials = credentials
        self._channels: dict[str, tuple[grpc.aio.Channel, ppb_grpc.PeerServiceStub]] = {}
        self._sessions: dict[tuple[str, str], PeerSession] = {}
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self._parked: dict[str, list[object]] = {}  # peer handles of handshakes a transport failure dropped
        self._closing: set[asyncio.Task] = set()  # disconnects and channel closes under way
        self._sent = itertools.count(1)  # handshakes, in the order they are sent
        self._used: dict[str, float] = {}  # address → loop time it was last used
        self._calls: dict[str, int] = {}  # address → calls through it now running
        self._sweeper: asyncio.Task | None = None
        self._closed = False
        self.records: dict[str, PeerRecord] = {}

    def _stub(self, address: str) -> ppb_grpc.PeerServiceStub:
        if address not in self._channels:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
            else:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = (channel, ppb_grpc.PeerServiceStub(channel))
        return self._channels[address][1]

    def _track(self, task: asyncio.Task) -> None:
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _disconnect(self, handles) -> None:
        """Give back these connects of the backend; the engine keeps a peer as long as a write to it runs."""
        for handle in handles:
            task = asyncio.get_running_loop().create_task(self._backend.disconnect(handle))
            self._track(task)
            task.add_done_callback(self._disconnected)

    def _disconnected(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("transfer engine %s could not disconnect a peer: %s", self._backend.name, task.exception())

    def _close_channel(self, address: str) -> None:
        entry = self._channels.pop(address, None)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(entry[0].close())
            self._track(task)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _pop_sessions(self, address: str) -> list[object]:
        """Drop the cached handshakes with a peer; returns their peer handles."""
        return [self._sessions.pop(k).peer_handle for k in [k for k in self._sessions if k[0] == address]]

    def forget(self, address: str) -> None:
        """Drop what is cached of a peer; the next call reconnects and handshakes again."""
        self._parked.setdefault(address, []).extend(self._pop_sessions(address))
        self._close_channel(address)

    # -- idle addresses -------------------------------------------------------------------------
    def _begin(self, address: str) -> None:
        """A call through `address` starts: it is in use until `_end`."""
        self._calls[address] = self._calls.get(address, 0) + 1
        self._used[address] = asyncio.get_running_loop().time()
        if not self._closed and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="peer idle sweeper")
            self._sweeper.add_done_callback(_sweeper_ended)

    def _end(self, address: str) -> None:
        self._used[address] = asyncio.get_running_loop().time()
        self._calls[address] -= 1
        if not self._calls[address]:
            del self._calls[address]

    async def _sweep(self) -> None:
        """Forget each address once it has been idle for idle_s; end when no address is left."""
        loop = asyncio.get_running_loop()
        while self._used:
            now = loop.time()
            due = now + self._idle_s  # an address in use is looked at again after idle_s at the latest
            for address, used in list(self._used.items()):
                if self._in_use(address):
                    continue
                if now - used >= self._idle_s:
                    self._forget_idle(address, now - used)
                else:
                    due = min(due, used + self._idle_s)
            if self._used:
                await asyncio.sleep(due - now)

    def _in_use(self, address: str) -> bool:
        """A call through the address runs, or the transfer engine writes through one of its handles."""
        if address in self._calls:
            return True
        handles = [s.peer_handle for k, s in self._sessions.items() if k[0] == address]
        return any(self._backend.writing(h) for h in handles + self._parked.get(address, []))

    def _forget_idle(self, address: str, idle: float) -> None:
        handles = self._pop_sessions(address) + self._parked.pop(address, [])
        self._disconnect(handles)
        self._close_channel(address)
        record = self.records.pop(address, None)
        del self._used[address]
        log.info("peer idle, forgotten", extra={"peer_address": address, "peer_broker_id": record and record.broker_id,
                                                "idle_s": round(idle, 3), "handshakes_given_back": len(handles)})

    # -- calls ----------------------------------------------------------------------------------
    async def _rpc(self, address: str, method: str, request, timeout: float):
        loop = asyncio.get_running_loop()
        timeout = max(timeout, 0.001)
        deadline = loop.time() + timeout
        self._begin(address)
        try:
            return await getattr(self._stub(address), method)(request, timeout=timeout, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            # DEADLINE_EXCEEDED is ours when our deadline passed; before it, the peer said it (an expired grant).
            silent = exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and loop.time() >= deadline - 0.001
            if silent or exc.code() is grpc.StatusCode.UNAVAILABLE:
                self.forget(address)
            if silent:
                raise BrokerError(Code.UNAVAILABLE, f"peer broker {address}: no answer within {timeout:.3f}s") from None
            if exc.code() is grpc.StatusCode.UNAVAILABLE and _TLS_FAILURE.search(exc.details() or ""):
                raise BrokerError(Code.PERMISSION_DENIED,
                                  f"peer broker {address}: TLS authentication failed: {exc.details()}") from None
            raise from_rpc_error(exc, f"peer broker {address}") from None
        finally:
            self._end(address)

    async def session(self, address: str, engine_id: str, *, refresh: bool, timeout: float) -> PeerSession:
        self._begin(address)
        try:
            return await self._session(address, engine_id, refresh, timeout)
        finally:
            self._end(address)

    async def _session(self, address: str, engine_id: str, refresh: bool, timeout: float) -> PeerSession:
        key = (address, engine_id)
        if not refresh and key in self._sessions:
            return self._sessions[key]
        if key in self._pending:  # one handshake per key at a time; others wait for its result
            return await asyncio.shield(self._pending[key])
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            session = await self._handshake(address, engine_id, timeout)
            future.set_result(session)
            return session
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else BrokerError(Code.CANCELLED, "cancelled"))
            future.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._pending[key]

    async def _handshake(self, address: str, engine_id: str, timeout: float) -> PeerSession:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:  # again only when the answer came from a process the peer has since replaced
            session = await self._handshake_once(address, engine_id, deadline - loop.time())
            if session is not None:
                return session

    async def _handshake_once(self, address: str, engine_id: str, timeout: float) -> PeerSession | None:
        request = ppb.HandshakeRequest(broker_id=self._broker_id, epoch=self._epoch, engine_id=engine_id,
                                       backend=self._backend.name)
        sent = next(self._sent)
        reply = await self._rpc(address, "Handshake", request, timeout)
        try:
            engine = convert.engine_layout_in(reply.engine)
        except BrokerError as exc:  # the peer's answer is unusable; the caller's request was fine
            raise BrokerError(Code.ABORTED, f"peer broker {address}: unusable handshake: {exc.message}") from None
        connecting = asyncio.ensure_future(self._backend.connect(reply.backend_metadata))
        try:
            handle = await asyncio.shield(connecting)  # a connect made is always given back
        except asyncio.CancelledError:
            connecting.add_done_callback(lambda f: f.cancelled() or f.exception() or self._disconnect([f.result()]))
            raise
        except TransferFailed as exc:
            raise BrokerError(Code.ABORTED, f"peer broker {address}: transfer engine {self._backend.name} "
                                            f"cannot use its handshake metadata: {exc}") from None
        session = PeerSession(address, reply.broker_id, reply.epoch, reply.generation, engine, handle)
        record = self.records.setdefault(address, PeerRecord(address))
        if record.epoch and record.epoch != reply.epoch and sent < record.sent:
            log.info("peer %s answered a handshake sent before its restart was seen (epoch %d, now %d); "
                     "handshaking again", address, reply.epoch, record.epoch)
            self._disconnect([handle])
            return None
        epoch_changed = bool(record.epoch) and record.epoch != reply.epoch
        replaced = self._parked.pop(address, [])
        if epoch_changed:
            log.info("peer %s restarted (epoch %d -> %d)", address, record.epoch, reply.epoch)
            replaced += self._pop_sessions(address)
        elif (old := self._sessions.pop((address, engine_id), None)) is not None:
            replaced.append(old.peer_handle)
        self._disconnect(replaced)
        record.broker_id, record.epoch, record.sent = reply.broker_id, reply.epoch, max(record.sent, sent)
        record.handshakes += 1
        if self._metrics is not None:
            self._metrics.peer_handshake(epoch_changed=epoch_changed)
        self._sessions[(address, engine_id)] = session
        return session

    async def claim(self, session: PeerSession, request_id: str, components: Sequence[ComponentKind],
                    dst_page_ids: np.ndarray, timeout: float) -> ClaimResult:
        request = ppb.ClaimGrantRequest(broker_id=self._broker_id, epoch=self._epoch,
                                        engine_id=session.engine.engine_id, request_id=request_id,
                                        components=[int(c) for c in components],
                                        dst_page_ids=dst_page_ids.tolist())
        reply = await self._rpc(session.address, "ClaimGrant", request, timeout)
        grant = Grant(convert.page_ids_in(reply.dst_page_ids), reply.claim_token, reply.remaining_ms / 1000)
        return ClaimResult(grant, reply.epoch, reply.generation)

    async def complete(self, address: str, engine_id: str, request_id: str, claim_token: str,
                       status: TransferStatus, timeout: float) -> State:
        request = ppb.CompleteTransferRequest(
            broker_id=self._broker_id, engine_id=engine_id, request_id=request_id, claim_token=claim_token,
            succeeded=status.state is not State.FAILED, code=status.code, reason=status.reason,
            pages=status.pages, runs=status.runs, bytes=status.bytes, truncated_pages=status.truncated_pages,
        )
        reply = await self._rpc(address, "CompleteTransfer", request, timeout)
        try:
            return State(reply.state)
        except ValueError:
            raise BrokerError(Code.ABORTED, f"peer broker {address}: receiver reports unknown state {reply.state} "
                                            f"for the grant") from None

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper], timeout=CLOSE_WAIT_S)
        for address in list(self._channels):
            self._close_channel(address)
        handles = [s.peer_handle for s in self._sessions.values()] + [h for p in self._parked.values() for h in p]
        self._sessions.clear()
        self._parked.clear()
        self._used.clear()
        self._disconnect(handles)
        if self._closing:
            _, late = await asyncio.wait(list(self._closing), timeout=CLOSE_WAIT_S)
            if late:
                log.warning("%d peer channels or transfer-engine peers not released within %.0fs", len(late),
                            CLOSE_WAIT_S)


def _sweeper_ended(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the peer idle sweeper failed: %r", task.exception(), exc_info=task.exception())
