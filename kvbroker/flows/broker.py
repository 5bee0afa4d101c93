"""The Broker: the domain façade the servicers call. One per broker process, built by server.py.

It owns the registry, the transfer table, the sessions and the backend, and hands each call on:
- lifecycle (server.py): `start`, `drain`, `close`;
- engines (BrokerService): `register_engine`, `unregister_engine`; sessions (sessions.py):
  `open_session`, `end_session`, `sessions`;
- receiver side, run by the Receiver (receiver.py): `expect_transfer` (BrokerService), which may
  offer the grant to its sender; `handshake` (with the transfer engine's metadata), `claim`,
  `complete`, `take_notices` (PeerService, peer_service.py);
- sender side: `transfer` (BrokerService): the claimed flow's command runs the Sender (sender.py),
  the offered flow's one part the PartSender (part_sender.py); `receive_offer`, `revoke_offer`
  (PeerService), the offered flow's offers, kept by the OfferIntake (offer_intake.py). Both senders
  share the send step (send_step.py) and reach peers through the PeerLink the Broker is built with;
- both sides: `watch`, `cancel`; `info` (GetBrokerInfo: engines, sessions, counts and the peers
  the PeerLink knows).
Each servicer method makes one call here. Where a request carries page lists, the call takes the
conversion as a callable (`command`) and looks the engine up (NOT_FOUND) before it runs it, so that
no page array is built for an engine this broker does not have.
New sessions, engines, grants, handshakes, offers, claims and transfers are refused UNAVAILABLE
once the drain has begun.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.core.errors import BrokerError, Code, engine_failed, not_found
from kvbroker.core.identity import PeerIdentity
from kvbroker.core.model import Component, EngineLayout, EngineSpec, TransferState
from kvbroker.flows.limits import Limits
from kvbroker.flows.offer_intake import OfferIntake
from kvbroker.flows.part_sender import PartCommand, PartSender
from kvbroker.flows.receiver import GrantCommand, Receiver
from kvbroker.flows.records import Grant, SendRecord, TransferRecord, TransferStatus
from kvbroker.flows.registry import Engine, Registry
from kvbroker.flows.sender import Sender, TransferCommand
from kvbroker.flows.sessions import Session, Sessions
from kvbroker.flows.transfers import TransferTable
from kvbroker.peers.link import GrantOffer, PartAck, PartNotice, PeerLink, PeerView

if TYPE_CHECKING:
    from kvbroker.ops.metrics import Metrics

log = logging.getLogger("kvbroker.transfer")


T = TypeVar("T")

REVOKE_ANSWER_MARGIN_S = 0.5  # what RevokeOffer keeps of its deadline for the answer itself


@dataclass(frozen=True)
class BrokerInfo:
    broker_id: str
    epoch: int
    backend: str
    peer_address: str
    engines: list[Engine]
    peers: list[PeerView]
    request_counts: dict[str, int]
    sessions: list[Session]


@dataclass(frozen=True)
class HandshakeView:
    """A Handshake's answer, as the domain gives it."""

    broker_id: str
    epoch: int
    generation: int
    backend: str
    metadata: bytes
    layout: EngineLayout


class Broker:
    def __init__(self, broker_id: str, epoch: int, backend: Backend, limits: Limits, peers: PeerLink,
                 metrics: Metrics | None = None, peer_address: str = "") -> None:
        self.broker_id = broker_id
        self.epoch = epoch  # this process's: new_epoch() in server.py, also handed to the peer clients
        self.peer_address = peer_address  # where peers reach this broker, named in the offers it makes
        self.backend = backend
        self.limits = limits
        self._peers = peers
        self.registry = Registry(limits.max_pages_per_request, observer=metrics, max_engines=limits.max_engines)
        # The table also logs each request's end; its fence is the receiver's revocation of an offered grant.
        self.table = TransferTable(observer=metrics, fence=lambda record: self.receiver.fence(record))
        self.sender = Sender(self.registry, self.table, backend, peers, limits)
        self.offers = OfferIntake(self.registry, self.table, peers, limits, broker_id, peer_address)
        self.part_sender = PartSender(self.registry, self.table, backend, peers, limits, self.offers)
        self.receiver = Receiver(self.registry, self.table, peers, limits, peer_address)
        self.accepting = True
        self.stopping = asyncio.Event()  # set when the drain is over: sessions' streams end
        self._register_lock = asyncio.Lock()
        self._sessions = Sessions(self.registry, self.unregister_engine)

    async def start(self) -> None:
        await self.backend.start()

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise BrokerError(Code.UNAVAILABLE, "broker is shutting down and accepts no new requests")

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let in-flight ones finish within `grace_s`, then fail the rest."""
        self.accepting = False
        busy = [r for r in self.table.live() if r.busy]
        if busy:
            log.info("draining %d in-flight requests (grace %.1fs)", len(busy), grace_s)
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in busy], timeout=grace_s)
        ended = self.table.live()
        for record in ended:
            await self._abort(record, Code.UNAVAILABLE, "broker shut down before the request completed")
        await self.offers.end_all(Code.UNAVAILABLE, "broker shut down before the request completed")
        await self.receiver.revoked(ended, timeout=self.limits.peer_settle_s)
        self.stopping.set()

    async def close(self) -> None:
        self.accepting = False
        self.stopping.set()
        await self._sessions.close(timeout=self.limits.peer_settle_s)
        await self.offers.close()  # its records fail UNAVAILABLE before the parts' tasks are cancelled
        await self.part_sender.close()
        await self.table.close(timeout=self.limits.peer_settle_s)
        for engine in self.registry:
            self.registry.remove(engine.engine_id)
            try:
                await _release(self.backend, engine)
            except BrokerError as exc:  # the other engines are still released
                log.warning("engine %s: %s", engine.engine_id, exc.reason)
        await self.backend.close()

    async def register_engine(self, spec: EngineSpec, session_id: str = "") -> Engine:
        """Map and register an engine; with `session_id`, it lives only as long as that session."""
        self._check_accepting()
        self._sessions.get(session_id)  # NOT_FOUND before any work
        async with self._register_lock:  # check() compares with the engines added before it
            self.registry.check(spec)
            engine = await _in_thread(self.registry.materialise, spec, undo=lambda e: e.release())
            try:
                try:
                    engine.backend_handle = await self.backend.register(engine.regions)
                except TransferFailed as exc:
                    raise engine_failed(self.backend.name, exc) from exc
                session = self._sessions.get(session_id)  # it may have ended while the memory was mapped
                engine.session_id = session_id
                self.registry.add(engine)
                if session is not None:
                    session.engine_ids.add(spec.engine_id)
            except BaseException:
                await asyncio.shield(_release(self.backend, engine))
                raise
        log.info("engine registered", extra={"engine_id": spec.engine_id, "bytes": engine.registered_bytes,
                                             "session_id": session_id})
        return engine

    async def unregister_engine(self, engine_id: str, wait_s: float) -> int:
        """Fail the engine's requests and release it, once no write into or out of its memory runs
        (a claimed transfer is let finish, an offered one is stopped; each wait bounded by `wait_s`)."""
        engine = self.registry.get(engine_id)
        live = self.table.live(engine_id)
        writing = [r for r in live if r.state is TransferState.TRANSFERRING and r.claimed_flow]
        if writing:  # never release memory a transfer engine is reading or writing
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in writing], timeout=wait_s)
        failed = 0
        ended = self.table.live(engine_id)
        for record in ended:
            failed += await self._abort(record, Code.ABORTED, f"engine {engine_id!r} was unregistered", wait_s)
        await self.receiver.revoked(ended, timeout=wait_s)  # its senders have stopped writing into it
        if engine_id in self.registry:
            self.registry.remove(engine_id)
            if (session := self._sessions.find(engine.session_id)) is not None:
                session.engine_ids.discard(engine_id)
            await _release(self.backend, engine)
        return failed

    def open_session(self, holder: str) -> Session:
        """A session to register engines under; `end_session` releases them."""
        self._check_accepting()
        return self._sessions.open(holder)

    def end_session(self, session_id: str, wait_s: float) -> None:
        """The session's stream ended: its engines are unregistered in a task of their own."""
        self._sessions.end(session_id, wait_s)

    def sessions(self) -> list[Session]:
        return list(self._sessions)

    def info(self) -> BrokerInfo:
        return BrokerInfo(self.broker_id, self.epoch, self.backend.name, self.peer_address, list(self.registry),
                          list(self._peers.records.values()), dict(self.table.counts), self.sessions())

    async def expect_transfer(self, engine_id: str, command: Callable[[], GrantCommand]) -> TransferStatus:
        """A grant (offered to its sender first, if named); NOT_FOUND before `command` converts pages."""
        self.registry.get(engine_id)
        cmd = command()
        self._check_accepting()
        return await self.receiver.expect(cmd)

    async def handshake(self, backend: str, engine_id: str) -> HandshakeView:
        """A peer's Handshake: the engine's layout and generation, the engine's metadata (ABORTED)."""
        if backend != self.backend.name:
            raise BrokerError(Code.FAILED_PRECONDITION,
                              f"backend: caller uses {backend!r}, this broker uses {self.backend.name!r}")
        self._check_accepting()
        engine = self.registry.get(engine_id)
        try:
            metadata = await self.backend.metadata()
        except TransferFailed as exc:
            raise engine_failed(self.backend.name, exc) from exc
        return HandshakeView(self.broker_id, self.epoch, engine.generation, self.backend.name, metadata,
                             engine.layout)

    def claim(self, identity: PeerIdentity, engine_id: str, request_id: str,
              command: Callable[[], tuple[Sequence[Component], np.ndarray]]) -> tuple[Grant, int]:
        """A claim; NOT_FOUND for an engine or a request not here, before `command` converts its pages."""
        self.registry.get(engine_id)
        try:
            self.table.get(engine_id, request_id)
        except BrokerError:
            raise not_found(f"request_id: no grant for request {request_id!r} on engine {engine_id!r}") from None
        components, dst_page_ids = command()
        self._check_accepting()
        return self.receiver.claim(identity, engine_id, request_id, tuple(components), dst_page_ids)

    def complete(self, identity: PeerIdentity, engine_id: str, request_id: str, claim_token: str, *,
                 succeeded: bool, code: int, reason: str, pages: int, runs: int) -> TransferState:
        return self.receiver.complete(identity, engine_id, request_id, claim_token, succeeded=succeeded, code=code,
                                      reason=reason, pages=pages, runs=runs)

    def take_notices(self, identity: PeerIdentity, notices: list[PartNotice]) -> list[PartAck]:
        return self.receiver.take_notices(identity, notices)

    def receive_offer(self, identity: PeerIdentity, sender_engine_id: str, pages: int,
                      command: Callable[[int], GrantOffer], epoch: int) -> None:
        """An offer; the engine it names looked up (NOT_FOUND) and its `pages` page ids held to the
        caller's quotas and the total (RESOURCE_EXHAUSTED) before `command` converts its pages."""
        if sender_engine_id:
            self.registry.get(sender_engine_id)
        self.offers.admit(identity, pages)
        offer = command(self.limits.max_pages_per_request)
        self._check_accepting()
        self.offers.receive_offer(identity, offer, epoch)

    async def revoke_offer(self, identity: PeerIdentity, engine_id: str, request_id: str, token: str, code: int,
                           reason: str, time_left: float | None) -> bool:
        """The receiver revokes its offer; the answer waits, bounded, until no write into it runs."""
        wait = self.limits.peer_rpc_timeout_s if time_left is None else max(0.0, time_left - REVOKE_ANSWER_MARGIN_S)
        return await self.offers.revoke(identity, engine_id, request_id, token, code, reason, wait)

    async def transfer(self, engine_id: str, command: Callable[[], TransferCommand | PartCommand],
                       timeout: float | None) -> TransferStatus:
        """One Transfer, the engine looked up (NOT_FOUND) before `command` converts its pages: the
        claimed flow's Sender for a TransferCommand, else the PartSender."""
        self.registry.get(engine_id)
        cmd = command()
        self._check_accepting()
        if isinstance(cmd, TransferCommand):
            return await self.sender.transfer(cmd, timeout)
        return await self.part_sender.send_part(cmd, timeout)

    async def watch(self, engine_id: str, request_id: str, *, states_only: bool = False, terminal_only: bool = False,
                    offer_wait_s: float = 0.0) -> AsyncGenerator[TransferStatus, None]:
        """NOT_FOUND before the stream starts, unless the offer lands within `offer_wait_s` (OfferIntake.held)."""
        await self.offers.held(engine_id, request_id, offer_wait_s)
        return self.table.watch(engine_id, request_id, states_only=states_only, terminal_only=terminal_only)

    async def cancel(self, engine_id: str, request_id: str, reason: str, offer_wait_s: float = 0.0) -> TransferStatus:
        """Fail a request (an offer on its way waited for up to `offer_wait_s`); returns once its peer has
        stopped writing into or reading out of it (an offered request: the offer's delivery and the
        revocation, each bounded by peer_rpc_timeout_s) or its task has ended (a claimed one)."""
        try:
            record = await self.offers.held(engine_id, request_id, offer_wait_s)
        except BrokerError as exc:
            if exc.code is Code.NOT_FOUND and offer_wait_s > 0 and engine_id in self.registry:
                self.offers.book.refuse_later(request_id)  # the offer waited for may still come: refused then
            raise
        await self._abort(record, Code.CANCELLED, f"cancelled: {reason[:256] or 'by the caller'}")
        await self.receiver.revoked([record], timeout=self.limits.peer_settle_s)
        return record.snapshot()

    async def _abort(self, record: TransferRecord, code: Code, reason: str, wait_s: float | None = None) -> int:
        if record.settled:
            return 0
        if isinstance(record, SendRecord):  # a sender's flow ends it: the intake an offered one, the task a claimed one
            if record.offer is not None:
                wait = self.limits.peer_rpc_timeout_s if wait_s is None else wait_s
                return await self.offers.abort(record, record.offer, code, reason, wait)
            task = self.table.interrupt(record, code, reason)  # the task fails the record with this cause
            if task is not None:
                await asyncio.wait([task], timeout=self.limits.peer_settle_s)
                return 1
        return int(self.table.fail(record, code, reason))


async def _release(backend: Backend, engine: Engine) -> None:
    if engine.backend_handle is not None:
        handle, engine.backend_handle = engine.backend_handle, None
        try:
            await backend.deregister(handle)
        except TransferFailed as exc:  # the memory stays mapped: the engine may still reach it
            raise engine_failed(backend.name, exc) from exc
    await asyncio.to_thread(engine.release)  # munmap, cuIpcCloseMemHandle, cuMemFree


async def _in_thread(fn: Callable[..., T], *args: object, undo: Callable[[T], object]) -> T:
    """`fn(*args)` in a worker thread. If the caller is cancelled meanwhile, the thread still runs to
    its end, and `undo` (also in a thread) releases what it made, so nothing is left mapped."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        def release(f: asyncio.Future[T]) -> None:
            if not f.cancelled() and f.exception() is None:
                loop.run_in_executor(None, undo, f.result())
        future.add_done_callback(release)
        raise
