"""The offered flow's sender side: grants receivers offered to this broker, and the parts written into them.

Called by the Broker (the façade):
- `receive_offer` (PeerService OfferGrant): the offer checked and kept in the OfferBook; one that
  names its engine becomes that engine's PENDING record at once (the server can watch it), and the
  handshake with the receiver is made ahead, so that no part waits for it.
- `revoke` (PeerService RevokeOffer): the receiver withdraws its offer: the offer ends, the record
  fails with the receiver's code, and the answer waits (bounded) until no write into it runs.
- `abort`: the local server cancels (or the engine goes, or the broker drains): the record fails,
  the receiver is told, and it returns once no write runs.
- `send_part` (Transfer without peer_address): one part, run as a task this object owns. Its phases:

    offer    the offer for the request id (waiting up to offer_wait_s) and the record it feeds
    session  the receiver's engine, from a cached or a new handshake (refreshed when the offer names
             another epoch or registry generation than the cached one)
    rules    every topology rule of topology.py for the part's components
    plan     where each component's pages land and the descriptors (parts.plan_part, pure)
    write    the part numbered, its entries reserved, TRANSFERRING; the engine moves the bytes, the
             engine's segments checked before and after (memory.check_segments: shrunk or poisoned)
    notify   one notice to the receiver (batched per peer by the Notifier); the last part then waits
             for every earlier one, and the request is SUCCEEDED

A part the plan refuses (outside the grant, over an earlier part, breaking a component's page
rule) leaves the request as it was, and nothing is written. Any other failure once the offer is
found fails the request: the receiver is told, the offer ends, no later part is accepted.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.core import topology
from kvbroker.core.errors import BrokerError, Code, invalid, precondition
from kvbroker.core.model import Component, TransferRole, TransferState
from kvbroker.core.parts import PartPages, PartPlan, plan_part
from kvbroker.core.validation import check_aux, check_identifier, check_part_pages, registered_pages
from kvbroker.edge.trust import PeerIdentity
from kvbroker.flows.offers import Offer, OfferBook
from kvbroker.flows.registry import Engine, Registry
from kvbroker.flows.transfers import TransferRecord, TransferStatus, TransferTable
from kvbroker.memory.mapping import check_segments
from kvbroker.peers.link import GrantOffer, PartNotice, PeerLink, PeerSession

if TYPE_CHECKING:
    from kvbroker.flows.broker import Limits

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class PartCommand:
    """A Transfer of the offered flow as the domain sees it."""

    request_id: str
    engine_id: str
    pages: tuple[tuple[Component, np.ndarray, int], ...]  # (component, source pages, dst_offset)
    last: bool
    aux: bytes = b""


class _Refused(Exception):
    """A part the plan refused: the request stays as it was."""

    def __init__(self, error: BrokerError) -> None:
        self.error = error


@dataclass
class _Part:
    """One part on its way: what its phases read, and what its failure path needs."""

    cmd: PartCommand
    engine: Engine
    budget: float
    caller_bound: bool  # the budget is the caller's deadline (its expiry is DEADLINE_EXCEEDED)
    deadline: float  # loop time
    offer: Offer | None = None
    record: TransferRecord | None = None
    part: int = -1  # its number, once begin_part gave it one
    numbered: bool = False  # begin_part ran: end_part must follow

    def left(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


def _ended_error(record: TransferRecord) -> BrokerError:
    """Why a part of an ended request is refused."""
    if record.state is TransferState.SUCCEEDED:
        return precondition(f"request {record.request_id!r} completed already; no part may follow")
    if record.code == Code.DEADLINE_EXCEEDED:
        return BrokerError(Code.DEADLINE_EXCEEDED, f"request {record.request_id!r} has failed: {record.reason}")
    return precondition(f"request {record.request_id!r} has failed: {record.reason}")


class PartSender:
    def __init__(self, registry: Registry, table: TransferTable, backend: Backend, peers: PeerLink,
                 limits: Limits) -> None:
        self._registry = registry
        self._table = table
        self._backend = backend
        self._peers = peers
        self._limits = limits
        self.offers = OfferBook(limits.max_offers, on_expired=self._expired)
        self._tasks: set[asyncio.Task] = set()

    def _own(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # offers in

    def receive_offer(self, identity: PeerIdentity, offer: GrantOffer, epoch: int) -> None:
        """Keep an offer; refused (and nothing kept) when it cannot be written here."""
        if offer.remaining_s > self._limits.max_grant_expiry_s:
            raise invalid(f"remaining_ms: {offer.remaining_s * 1000:.0f} exceeds this broker's limit of "
                          f"{self._limits.max_grant_expiry_s * 1000:.0f} (max_grant_expiry_s)")
        engine = None
        if offer.sender_engine_id:
            engine = self._registry.get(offer.sender_engine_id)
            for kind in offer.granted:
                registered_pages(engine.layout, [kind])
        loop = asyncio.get_running_loop()
        held = Offer(offer.peer_address, identity.name, epoch, offer.engine_id, offer.request_id,
                     offer.sender_engine_id, offer.granted, offer.token, offer.generation,
                     loop.time() + offer.remaining_s)
        self.offers.add(held)
        if engine is not None:
            try:
                self._attach(held, engine.engine_id)
            except BrokerError:
                self.offers.end(held, precondition("offer refused"))
                raise
        self._own(self._prefetch(held), f"handshake ahead {offer.request_id}")

    def _attach(self, offer: Offer, engine_id: str) -> TransferRecord:
        record = self._table.add_send(engine_id, offer.request_id, offer.components, peer=offer.receiver_address)
        record.offer, offer.record = offer, record
        return record

    async def _prefetch(self, offer: Offer) -> None:
        try:
            await self._session_for(offer, self._limits.peer_rpc_timeout_s)
        except (BrokerError, TimeoutError) as exc:
            log.debug("handshake ahead of request %s with %s: %s", offer.request_id, offer.receiver_address, exc)

    def _expired(self, offer: Offer) -> None:
        if offer.record is not None:
            self._table.fail(offer.record, Code.DEADLINE_EXCEEDED,
                             f"grant expired: the offer of {offer.request_id!r} ran out before its last part")

    def _find_offer(self, receiver_id: str, engine_id: str, request_id: str) -> Offer | None:
        """A receiver's offer, live in the book or ended but still held by its record."""
        live = self.offers.by_receiver(receiver_id, engine_id, request_id)
        if live is not None:
            return live
        for record in self._table.with_request_id(request_id):
            offer = record.offer
            if isinstance(offer, Offer) and offer.engine_id == engine_id and offer.receiver_id == receiver_id:
                return offer
        return None

    async def revoke(self, identity: PeerIdentity, engine_id: str, request_id: str, token: str, code: int,
                     reason: str, wait_s: float) -> bool:
        offer = self._find_offer(identity.name, engine_id, request_id)
        if offer is None:
            return True  # nothing of it here: nothing writes into it
        if not hmac.compare_digest(token.encode(), offer.token.encode()):
            raise BrokerError(Code.PERMISSION_DENIED, "offer_token: does not match the offer")
        reason = reason[:1024] or "no reason given"
        offer.withdrawn = True
        self.offers.end(offer, precondition(f"the receiver withdrew grant {request_id!r}: {reason}"))
        if offer.record is not None:
            cause = Code(code) if code in Code._value2member_map_ and code else Code.ABORTED
            self._table.fail(offer.record, cause, f"the receiver {identity.name!r} withdrew the grant: {reason}")
        return await self._quiet(offer, wait_s)

    @staticmethod
    async def _quiet(offer: Offer, wait_s: float) -> bool:
        try:
            await asyncio.wait_for(offer.quiet.wait(), wait_s)
            return True
        except TimeoutError:
            return False

    async def abort(self, record: TransferRecord, code: Code, reason: str, wait_s: float) -> int:
        """Fail an offered request here, tell its receiver, and wait (bounded) until no write runs."""
        offer = record.offer
        if not self._table.fail(record, code, reason):
            return 0
        if isinstance(offer, Offer):
            self.offers.end(offer, precondition(f"request {record.request_id!r} has failed: {reason}"))
            await self._quiet(offer, wait_s)  # the receiver reuses its pages once told
            await self._tell_failed(offer, record.code, record.reason)
        return 1

    async def withdraw_all(self, code: Code, reason: str) -> None:
        """The broker stops: every offer it still holds ends, and each receiver is told at once rather
        than left to its grant's expiry (each told within peer_rpc_timeout_s; an offer whose request a
        Transfer had named was aborted with it already)."""
        offers = [offer for offer in self.offers if offer.ended is None]
        for offer in offers:
            self.offers.end(offer, BrokerError(code, reason))
        await asyncio.gather(*(self._tell_failed(offer, int(code), reason) for offer in offers))

    # parts out

    async def send_part(self, cmd: PartCommand, timeout: float | None) -> TransferStatus:
        """Check the part against the local engine, then run it as a task this object owns (a part
        is never cut short mid-write by its caller going away); its status after the part."""
        check_identifier(cmd.request_id, "request_id")
        engine = self._registry.get(cmd.engine_id)
        check_segments(engine.held, cmd.engine_id)
        check_part_pages(engine.layout, cmd.pages, "pages", self._limits.max_pages_per_request)
        check_aux(cmd.aux, last=cmd.last, max_aux_bytes=self._limits.max_aux_bytes)
        if not cmd.pages and not cmd.last:
            raise invalid("pages: a part with more_parts needs pages; only the last part may carry none")
        limit = self._limits.transfer_timeout_s
        budget = limit if timeout is None else min(timeout, limit)
        job = _Part(cmd, engine, budget, timeout is not None and timeout <= limit,
                    asyncio.get_running_loop().time() + budget)
        task = self._own(self._part(job), f"part {cmd.engine_id}/{cmd.request_id}")
        return await asyncio.shield(task)

    async def _part(self, job: _Part) -> TransferStatus:
        try:
            try:
                async with asyncio.timeout(job.budget):
                    return await self._phases(job)
            except TimeoutError:
                code = Code.DEADLINE_EXCEEDED if job.caller_bound else Code.UNAVAILABLE
                raise BrokerError(code, f"the part did not complete within {job.budget:.3f}s") from None
        except _Refused as refused:
            raise refused.error from None
        except BrokerError as exc:
            await self._fail(job, exc)
            raise
        except asyncio.CancelledError:
            await self._fail(job, BrokerError(Code.CANCELLED, "the part was cancelled"))
            raise
        except Exception as exc:  # a bug must end the request, not wedge it
            log.exception("part of %s failed unexpectedly", job.cmd.request_id)
            error = BrokerError(Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            await self._fail(job, error)
            raise error from exc
        finally:
            if job.numbered:
                job.offer.end_part()

    async def _phases(self, job: _Part) -> TransferStatus:
        offer, record = await self._offer(job)
        session = await self._session(job)
        self._rules(job, session)
        plan = self._plan(job, session)
        await self._write(job, session, plan)
        await self._notify(job, plan)
        if job.cmd.last:
            await self._finish(job)
        return record.snapshot()

    async def _offer(self, job: _Part) -> tuple[Offer, TransferRecord]:
        """The offer this part writes into: held already, or waited for up to offer_wait_s."""
        cmd = job.cmd
        offer = self.offers.find(cmd.request_id, cmd.engine_id)
        if offer is None:
            record = self._table.find(cmd.engine_id, cmd.request_id)
            if record is not None and record.role is TransferRole.SENDER:
                if isinstance(record.offer, Offer) and record.state.terminal:
                    raise _Refused(_ended_error(record))
                if not record.state.terminal:
                    raise BrokerError(Code.ALREADY_EXISTS, f"request_id: request {cmd.request_id!r} is already in "
                                                           f"flight on engine {cmd.engine_id!r} (the claimed flow)")
        try:
            offer = await self.offers.take(cmd.request_id, cmd.engine_id, min(self._limits.offer_wait_s, job.left()))
        except BrokerError as exc:
            raise _Refused(exc) from None
        job.offer = offer
        record = offer.record if offer.record is not None else self._attach(offer, cmd.engine_id)
        job.record = record
        if record.state.terminal:
            raise _Refused(_ended_error(record))
        return offer, record

    async def _session_for(self, offer: Offer, timeout: float) -> PeerSession:
        """The receiver's engine; a cached handshake from another epoch or generation than the
        offer's is refreshed. The broker there must be the one that offered."""
        address, engine_id = offer.receiver_address, offer.engine_id
        session = await self._peers.session(address, engine_id, refresh=False, timeout=timeout)
        if (session.epoch, session.generation) != (offer.receiver_epoch, offer.generation):
            session = await self._peers.session(address, engine_id, refresh=True, timeout=timeout)
        if session.broker_id != offer.receiver_id:
            raise BrokerError(Code.ABORTED, f"the broker at {address} is {session.broker_id!r}, not "
                                            f"{offer.receiver_id!r} that offered grant {offer.request_id!r}")
        return session

    async def _session(self, job: _Part) -> PeerSession:
        return await self._session_for(job.offer, min(job.left(), self._limits.peer_rpc_timeout_s))

    def _rules(self, job: _Part, session: PeerSession) -> None:
        topology.check_transfer(job.engine.layout, session.engine, [kind for kind, _, _ in job.cmd.pages])

    def _plan(self, job: _Part, session: PeerSession) -> PartPlan:
        pages = [PartPages(kind, ids, offset) for kind, ids, offset in job.cmd.pages]
        try:
            return plan_part(job.engine.layout, session.engine, job.offer.granted, job.offer.coverage, pages,
                             last=job.cmd.last)
        except BrokerError as exc:
            if exc.code is Code.ABORTED:  # the receiver's grant is inconsistent with its engine
                raise
            raise _Refused(exc) from None

    async def _write(self, job: _Part, session: PeerSession, plan: PartPlan) -> None:
        offer = job.offer
        try:
            job.part = offer.begin_part(job.cmd.last)
        except BrokerError as exc:
            raise _Refused(exc) from None
        job.numbered = True
        for x in plan.landed:
            offer.coverage.mark(x.kind, x.dst_offset, x.pages)
        self._table.start(job.record)
        if not plan.descriptors.count:
            return
        budget = min(job.left(), offer.remaining_s(asyncio.get_running_loop().time()))
        check_segments(job.engine.held, job.cmd.engine_id)
        try:
            await self._backend.write(session.peer_handle, plan.descriptors, budget)
        except TransferFailed as exc:
            check_segments(job.engine.held, job.cmd.engine_id)  # a shrunk source is the cause to report
            raise BrokerError(Code.ABORTED, f"transfer engine {self._backend.name}: {exc}") from exc
        except TimeoutError as exc:
            code = Code.DEADLINE_EXCEEDED if job.caller_bound and job.left() <= 0.01 else Code.ABORTED
            raise BrokerError(code, f"transfer engine {self._backend.name}: {exc}") from exc
        check_segments(job.engine.held, job.cmd.engine_id)  # shrunk during the write: zeros may have been sent

    async def _notify(self, job: _Part, plan: PartPlan) -> None:
        offer, cmd = job.offer, job.cmd
        if offer.ended is not None:  # withdrawn while the part was written: the receiver knows
            raise BrokerError(offer.ended.code, offer.ended.message)
        notice = PartNotice(offer.engine_id, offer.request_id, offer.token, job.part,
                            job.part + 1 if cmd.last else 0, True, plan.landed, cmd.aux if cmd.last else b"")
        ack = await self._peers.notify(offer.receiver_address, notice)
        if ack.code:
            code = Code(ack.code) if ack.code in Code._value2member_map_ else Code.ABORTED
            raise BrokerError(code, f"the receiver refused part {job.part}: {ack.reason}")
        if ack.state is TransferState.FAILED:
            raise BrokerError(Code.ABORTED, f"the receiver's grant has failed: {ack.reason}")
        self._table.progress(job.record, landed={x.kind: x.pages for x in plan.landed}, runs=plan.runs,
                             nbytes=plan.descriptors.nbytes)

    async def _finish(self, job: _Part) -> None:
        """The last part landed: once every earlier part has too, the request succeeded."""
        offer = job.offer
        offer.end_part()
        job.numbered = False
        if not await self._quiet(offer, job.left()):
            raise BrokerError(Code.DEADLINE_EXCEEDED if job.caller_bound else Code.UNAVAILABLE,
                              "earlier parts of the request did not complete in time")
        if job.record.state.terminal:
            raise _ended_error(job.record)
        self._table.succeed(job.record, truncated=offer.coverage.unfilled())
        self.offers.end(offer, precondition(f"request {offer.request_id!r} completed already; no part may follow"))

    async def _fail(self, job: _Part, error: BrokerError) -> None:
        """The part failed after its offer was found: the request fails, and its receiver is told."""
        offer, record = job.offer, job.record
        if offer is None or record is None:
            return
        if job.numbered:
            job.offer.end_part()
            job.numbered = False
        if not self._table.fail(record, error.code, error.message):
            return
        self.offers.end(offer, precondition(f"request {offer.request_id!r} has failed: {error.message}"))
        await self._quiet(offer, self._limits.peer_rpc_timeout_s)  # the receiver reuses its pages once told
        await self._tell_failed(offer, record.code, record.reason)

    async def _tell_failed(self, offer: Offer, code: int, reason: str) -> None:
        if offer.withdrawn:
            return  # the receiver withdrew it: it knows
        notice = PartNotice(offer.engine_id, offer.request_id, offer.token, offer.next_part, 0, False,
                            code=code, reason=reason)
        try:
            await asyncio.wait_for(self._peers.notify(offer.receiver_address, notice),
                                   self._limits.peer_rpc_timeout_s)
        except (BrokerError, TimeoutError) as exc:
            log.debug("could not tell %s that %s failed: %s", offer.receiver_address, offer.request_id, exc)

    async def close(self) -> None:
        for offer in self.offers.close():
            if offer.record is not None:
                self._table.fail(offer.record, Code.UNAVAILABLE, "broker shut down before the request completed")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self._limits.peer_rpc_timeout_s * 2)
