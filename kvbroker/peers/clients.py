"""Broker to broker, the sending side: PeerClients, the PeerLink (peer_link.py) a Broker is built with.

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

The offered flow's calls: `offer` and `revoke` (RevokeOffer) for the receiving side, `notify`
for the sending side, whose notices go through a Notifier (notifier.py) that batches them per
peer. Each offer and each batch is a message of the peer's NotifyStream (notice_stream.py), or an
OfferGrant (NotifyParts) call where the peer does not serve it.

An address left unused is forgotten by the idle policy, IdlePeers (peer_idle.py). The receiving
side is peer_service.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.model import Component, TransferState
from kvbroker.core.tasks import OwnedTasks
from kvbroker.core.validation import declared_regions
from kvbroker.flows.transfers import Grant, TransferStatus
from kvbroker.ops.metrics import Metrics
from kvbroker.peers import wire
from kvbroker.peers.channels import PeerChannels
from kvbroker.peers.idle import IdlePeers
from kvbroker.peers.link import ClaimResult, GrantOffer, PartAck, PartNotice, PeerSession, ReplyBounds
from kvbroker.peers.notice_stream import NoticeStreams
from kvbroker.peers.notifier import Notifier
from kvbroker.peers.vouch import TLS_FAILURE, Vouch, closed_under
from kvbroker.peers.wire import from_rpc_error
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb

log = logging.getLogger("kvbroker.peer")  # the name peer.py logged under, kept for the log lines

CLOSE_WAIT_S = 10.0  # how long close waits for channels to close and the backend to take peers back


@dataclass
class PeerRecord:
    address: str
    broker_id: str = ""
    epoch: int = 0
    handshakes: int = 0
    sent: int = 0  # send order of the newest handshake whose answer was applied


class PeerClients:
    """The PeerLink of a Broker: handshakes, claims and completion notices over gRPC."""

    def __init__(self, broker_id: str, epoch: int, backend: Backend, *, idle_s: float, rpc_timeout_s: float = 5.0,
                 channel_options: Sequence[tuple[str, object]] = (),
                 credentials: Callable[[], tuple[int, grpc.ChannelCredentials]] | None = None,
                 metrics: Metrics | None = None,
                 limits: ReplyBounds | None = None, notice_stream: bool = True) -> None:
        self._metrics = metrics
        self._closing = OwnedTasks()  # disconnects and channel closes under way
        # half of what a peer takes in one message of notices: the rest is slack for the framing
        batch_bytes = (min(limits.port_bytes, limits.notice_bytes) // 2) if limits is not None else 1 << 62
        self.notifier = Notifier(self._send_notices, timeout_s=rpc_timeout_s, max_batch_bytes=batch_bytes)
        self._limits = limits  # a peer's answer is held to our bounds before anything is built from it
        self._broker_id = broker_id
        self._epoch = epoch
        self._backend = backend
        self._channels = PeerChannels(channel_options, credentials, rpc_timeout_s, self._closing.add)
        self._vouch = Vouch(broker_id, epoch, backend, self._channels)  # who answered: not us, and certified
        self._sessions: dict[tuple[str, str], PeerSession] = {}
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self._parked: dict[str, list[object]] = {}  # peer handles of handshakes a transport failure dropped
        self._sent = itertools.count(1)  # handshakes, in the order they are sent
        self._idle = IdlePeers(idle_s, busy=self._writing_through, forget=self._forget_idle)
        self._notices = NoticeStreams(self._channels.stub, self.forget, self._rpc, enabled=notice_stream,
                                      idle=self._idle, limits=limits, metrics=metrics)
        self.records: dict[str, PeerRecord] = {}

    def _disconnect(self, handles) -> None:
        """Give back these connects of the backend; the engine keeps a peer as long as a write to it runs."""
        for handle in handles:
            task = asyncio.get_running_loop().create_task(self._backend.disconnect(handle))
            self._closing.add(task)
            task.add_done_callback(self._disconnected)

    def _disconnected(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("transfer engine %s could not disconnect a peer: %s", self._backend.name, task.exception())

    def _pop_sessions(self, address: str) -> list[object]:
        """Drop the cached handshakes with a peer; returns their peer handles."""
        return [self._sessions.pop(k).peer_handle for k in [k for k in self._sessions if k[0] == address]]

    def forget(self, address: str) -> None:
        """Drop what is cached of a peer; the next call reconnects (calls under way end by their deadlines)."""
        self._parked.setdefault(address, []).extend(self._pop_sessions(address))
        self._notices.forget(address)
        self._channels.close(address, grace=self._channels.grace_s + 1.0)

    def _writing_through(self, address: str) -> bool:
        """Whether the transfer engine writes through one of the address's handles."""
        handles = [s.peer_handle for k, s in self._sessions.items() if k[0] == address]
        return any(self._backend.writing(h) for h in handles + self._parked.get(address, []))

    def _forget_idle(self, address: str, idle: float) -> None:
        handles = self._pop_sessions(address) + self._parked.pop(address, [])
        self._disconnect(handles)
        self._notices.forget(address)
        self._channels.close(address, forget=True)
        record = self.records.pop(address, None)
        log.info("peer idle, forgotten", extra={"peer_address": address, "peer_broker_id": record and record.broker_id,
                                                "idle_s": round(idle, 3), "handshakes_given_back": len(handles)})

    async def _rpc(self, address: str, method: str, request, timeout: float):
        loop = asyncio.get_running_loop()
        timeout = max(timeout, 0.001)
        deadline = loop.time() + timeout
        self._idle.begin(address)
        try:
            reply = await getattr(self._channels.stub(address), method)(request, timeout=timeout, wait_for_ready=False)
            if self._limits is not None and (refusal := self._limits.check_lists(reply)) is not None:
                raise BrokerError(Code.RESOURCE_EXHAUSTED, f"peer broker {address}: {method} answer: {refusal.message}")
            return reply
        except asyncio.CancelledError as exc:  # grpc cancels a channel's calls when it closes: a peer failure
            raise closed_under(exc, address, method) from None
        except grpc.aio.AioRpcError as exc:
            # DEADLINE_EXCEEDED is ours when our deadline passed; before it, the peer said it (an expired grant).
            silent = exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and loop.time() >= deadline - 0.001
            if silent or exc.code() is grpc.StatusCode.UNAVAILABLE:
                self.forget(address)
            if silent:
                raise BrokerError(Code.UNAVAILABLE, f"peer broker {address}: no answer within {timeout:.3f}s") from None
            if exc.code() is grpc.StatusCode.UNAVAILABLE and TLS_FAILURE.search(exc.details() or ""):
                raise BrokerError(Code.PERMISSION_DENIED,
                                  f"peer broker {address}: TLS authentication failed: {exc.details()}") from None
            raise from_rpc_error(exc, f"peer broker {address}") from None
        finally:
            self._idle.end(address)

    async def session(self, address: str, engine_id: str, *, refresh: bool, timeout: float,
                      expect: str = "") -> PeerSession:
        self._channels.dial_as(address, expect)  # TLS refuses a certificate without it; answers must give it
        self._idle.begin(address)
        try:
            return await self._session(address, engine_id, refresh, timeout)
        finally:
            self._idle.end(address)

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
        await self._vouch.check(address, reply.broker_id, timeout, reply.backend_metadata)
        try:
            engine = wire.engine_layout_in(reply.engine)
            regions = declared_regions(engine)  # every write to the peer lies in these (planner)
        except BrokerError as exc:  # the peer's answer is unusable; the caller's request was fine
            raise BrokerError(Code.ABORTED, f"peer broker {address}: unusable handshake: {exc.reason}") from None
        connecting = asyncio.ensure_future(self._backend.connect(reply.backend_metadata, regions))
        try:
            handle = await asyncio.shield(connecting)  # a connect made is always given back
        except asyncio.CancelledError:
            connecting.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else self._disconnect([f.result()]))
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

    async def claim(self, session: PeerSession, request_id: str, components: Sequence[Component],
                    dst_page_ids: np.ndarray, timeout: float) -> ClaimResult:
        request = ppb.ClaimGrantRequest(broker_id=self._broker_id, epoch=self._epoch,
                                        engine_id=session.engine.engine_id, request_id=request_id,
                                        components=[wire.enum_out(c, pb.Component) for c in components],
                                        dst_page_ids=dst_page_ids.tolist())
        reply = await self._rpc(session.address, "ClaimGrant", request, timeout)
        grant = Grant(wire.page_ids_in(reply.dst_page_ids), reply.claim_token, reply.remaining_ms / 1000)
        return ClaimResult(grant, reply.epoch, reply.generation)

    async def complete(self, address: str, engine_id: str, request_id: str, claim_token: str,
                       status: TransferStatus, timeout: float) -> TransferState:
        request = ppb.CompleteTransferRequest(
            broker_id=self._broker_id, engine_id=engine_id, request_id=request_id, claim_token=claim_token,
            succeeded=status.state is not TransferState.FAILED, code=status.code, reason=status.reason,
            pages=status.pages, runs=status.runs, bytes=status.bytes, truncated_pages=status.truncated_pages,
        )
        return wire.completion_state_in((await self._rpc(address, "CompleteTransfer", request, timeout)).state,
                                        address)

    async def offer(self, address: str, offer: GrantOffer, timeout: float) -> tuple[str, int]:
        reply = await self._notices.offer(address, wire.grant_offer_out(offer, self._broker_id, self._epoch), timeout)
        await self._vouch.check(address, reply.broker_id, timeout)
        return reply.broker_id, reply.epoch

    async def revoke(self, address: str, engine_id: str, request_id: str, token: str, code: int, reason: str,
                     timeout: float) -> bool:
        request = ppb.RevokeOfferRequest(broker_id=self._broker_id, epoch=self._epoch, engine_id=engine_id,
                                         request_id=request_id, offer_token=token, code=code, reason=reason[:1024])
        reply = await self._rpc(address, "RevokeOffer", request, timeout)
        return reply.quiesced

    async def notify(self, address: str, notice: PartNotice) -> PartAck:
        return await self.notifier.notify(address, notice)

    async def _send_notices(self, address: str, notices: Sequence[PartNotice], timeout: float) -> list[PartAck]:
        request = ppb.NotifyPartsRequest(broker_id=self._broker_id, epoch=self._epoch,
                                         notices=[wire.part_notice_out(n) for n in notices])
        return [wire.part_ack_in(a, address) for a in await self._notices.send(address, request, timeout)]

    async def close(self) -> None:
        await self.notifier.close()
        await self._notices.close()
        await self._idle.close(CLOSE_WAIT_S)
        self._channels.close_all()
        handles = [s.peer_handle for s in self._sessions.values()] + [h for p in self._parked.values() for h in p]
        self._sessions.clear()
        self._parked.clear()
        self._disconnect(handles)
        if late := await self._closing.wait(CLOSE_WAIT_S):
                log.warning("%d peer channels or transfer-engine peers not released within %.0fs", len(late),
                            CLOSE_WAIT_S)
