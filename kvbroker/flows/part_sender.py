"""The offered flow's sender: the parts the local server writes into grants offered to this broker.

The offers themselves (their intake, revocation, abort and end) are the OfferIntake's
(offer_intake.py). Called by the Broker (the façade): `send_part` (Transfer without
peer_address), one part, run as a task this object owns. Its phases:

    offer    the offer for the request id from the part's receiver (receiver_broker_id; unnamed, the
             one offer there is), waiting up to offer_wait_s, and the record it feeds; the other
             receivers' offers of the request for this engine end
    session  the receiver's engine, from a cached or a new handshake (refreshed when the offer names
             another epoch or registry generation than the cached one)
    rules    every topology rule of topology.py for the part's components; the grant's pages
             inside the receiver's engine (INVALID_ARGUMENT, as the claimed flow's planner says)
    plan     where each component's pages land and the descriptors (parts.plan_part, pure)
    write    the part numbered, its entries reserved, then the send step both flows share
             (send_step.write): TRANSFERRING, the engine moves the bytes, its segments checked
    notify   one notice to the receiver (batched per peer by the Notifier); the last part then waits
             for every earlier one, and the request is SUCCEEDED

A part the plan refuses (outside the grant, over an earlier part, breaking a component's page
rule) leaves the request as it was, and nothing is written. Any other failure once the offer is
found fails the request (OfferIntake.fail): the receiver is told, the offer ends, no later part
is accepted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbroker.backends.base import Backend
from kvbroker.core import topology
from kvbroker.core.errors import BrokerError, Code, invalid, peer_code, precondition
from kvbroker.core.model import Component, TransferState
from kvbroker.core.parts import PartPages, PartPlan, check_grant_inside, plan_part
from kvbroker.core.tasks import OwnedTasks
from kvbroker.core.validation import check_aux, check_identifier, check_part_pages
from kvbroker.flows.offer_intake import OfferIntake
from kvbroker.flows.records import Offer, SendRecord, TransferStatus, ended_error
from kvbroker.flows.registry import Registry
from kvbroker.flows.send_step import SendJob, failure, write
from kvbroker.flows.transfers import TransferTable
from kvbroker.memory.mapping import check_segments
from kvbroker.peers.link import PartNotice, PeerLink, PeerSession

if TYPE_CHECKING:
    from kvbroker.flows.limits import Limits

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class PartCommand:
    """A Transfer of the offered flow as the domain sees it."""

    request_id: str
    engine_id: str
    pages: tuple[tuple[Component, np.ndarray, int], ...]  # (component, source pages, dst_offset)
    last: bool
    aux: bytes = b""
    receiver_id: str = ""  # the receiving broker whose offer the part is for; empty: the one offer there is


class _Refused(Exception):
    """A part the plan refused: the request stays as it was."""

    def __init__(self, error: BrokerError) -> None:
        self.error = error


@dataclass
class _Part(SendJob):
    """One part on its way: what its phases read, and what its failure path needs."""

    cmd: PartCommand
    offer: Offer | None = None  # both set by the offer phase, before the phases that read them
    record: SendRecord | None = None
    part: int = -1  # its number, once begin_part gave it one
    numbered: bool = False  # begin_part ran: end_part must follow

    def end_part(self) -> None:
        """The part's write is over (or never ran): the offer counts it as such, once."""
        if self.numbered and self.offer is not None:
            self.offer.end_part()
        self.numbered = False


class PartSender:
    def __init__(self, registry: Registry, table: TransferTable, backend: Backend, peers: PeerLink,
                 limits: Limits, intake: OfferIntake) -> None:
        self._registry = registry
        self._table = table
        self._backend = backend
        self._peers = peers
        self._limits = limits
        self._intake = intake
        self._tasks = OwnedTasks()

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
        job = _Part(cmd.engine_id, engine, *SendJob.budget_for(timeout, self._limits.transfer_timeout_s), cmd)
        task = self._tasks.spawn(self._part(job), f"part {cmd.engine_id}/{cmd.request_id}")
        return await asyncio.shield(task)

    async def _part(self, job: _Part) -> TransferStatus:
        try:
            async with asyncio.timeout(job.budget):
                return await self._phases(job)
        except _Refused as refused:
            raise refused.error from None
        except (Exception, asyncio.CancelledError) as exc:
            error = failure(exc, job, "the part", job.cmd.request_id,
                            BrokerError(Code.CANCELLED, "the part was cancelled"))
            await self._fail(job, error)
            if error is exc or isinstance(exc, asyncio.CancelledError):
                raise
            raise error from (None if isinstance(exc, TimeoutError) else exc)
        finally:
            job.end_part()

    async def _phases(self, job: _Part) -> TransferStatus:
        offer, record = await self._offer(job)
        session = await self._session(offer, job)
        self._rules(job, offer, session)
        plan = self._plan(job, offer, session)
        await self._write(job, offer, record, session, plan)
        await self._notify(job, offer, record, plan)
        if job.cmd.last:
            await self._finish(job, offer, record)
        return record.snapshot()

    async def _offer(self, job: _Part) -> tuple[Offer, SendRecord]:
        """The offer this part writes into: held already, or waited for up to offer_wait_s."""
        cmd = job.cmd
        try:
            offer = self._intake.book.find(cmd.request_id, cmd.engine_id, cmd.receiver_id)
        except BrokerError as exc:
            raise _Refused(exc) from None
        if offer is None:
            held = self._table.find_as(SendRecord, cmd.engine_id, cmd.request_id)
            if held is not None:
                if held.offer is not None and held.state.terminal:
                    raise _Refused(ended_error(held, "request"))
                if held.offer is not None:  # live, into another receiver's offer than the one this part names
                    raise _Refused(precondition(
                        f"receiver_broker_id: request {cmd.request_id!r} is being written into the offer of "
                        f"receiver {held.offer.receiver_id!r}, not {cmd.receiver_id!r}"))
                if not held.state.terminal:
                    raise BrokerError(Code.ALREADY_EXISTS, f"request_id: request {cmd.request_id!r} is already in "
                                                           f"flight on engine {cmd.engine_id!r} (the claimed flow)")
        try:
            wait_s = min(self._limits.offer_wait_s, job.left())
            offer = await self._intake.book.take(cmd.request_id, cmd.engine_id, wait_s, cmd.receiver_id)
        except BrokerError as exc:
            raise _Refused(exc) from None
        try:
            record = self._intake.record_for(offer, cmd.engine_id)
        except BrokerError as exc:
            if exc.code is Code.FAILED_PRECONDITION:  # another receiver's offer is being written
                raise _Refused(exc) from None
            raise
        job.offer = offer
        job.record = record
        if record.state.terminal:
            raise _Refused(ended_error(record, "request"))
        return offer, record

    async def _session(self, offer: Offer, job: _Part) -> PeerSession:
        return await self._intake.session_for(offer, job.rpc_timeout(self._limits.peer_rpc_timeout_s))

    def _rules(self, job: _Part, offer: Offer, session: PeerSession) -> None:
        """The topology rules, and the grant's pages inside the receiver's engine (a receiver whose
        grant names pages it does not have fails the request: every later part would write them)."""
        components = [kind for kind, _, _ in job.cmd.pages]
        topology.check_transfer(job.engine.layout, session.engine, components)
        check_grant_inside(session.engine, offer.granted, components, self._limits.max_pages_per_request)

    def _plan(self, job: _Part, offer: Offer, session: PeerSession) -> PartPlan:
        pages = [PartPages(kind, ids, offset) for kind, ids, offset in job.cmd.pages]
        try:
            return plan_part(job.engine.layout, session.engine, offer.granted, offer.coverage, pages,
                             last=job.cmd.last, src_offsets=offer.src_offsets)
        except BrokerError as exc:
            raise _Refused(exc) from None

    async def _write(self, job: _Part, offer: Offer, record: SendRecord, session: PeerSession,
                     plan: PartPlan) -> None:
        try:
            job.part = offer.begin_part(job.cmd.last)
        except BrokerError as exc:
            raise _Refused(exc) from None
        job.numbered = True
        for x in plan.landed:
            offer.coverage.mark(x.kind, x.dst_offset, x.pages)
        await write(self._backend, job, session.peer_handle, plan.descriptors,
                    lambda: min(job.left(), offer.remaining_s(asyncio.get_running_loop().time())),
                    lambda: self._table.start(record))

    async def _notify(self, job: _Part, offer: Offer, record: SendRecord, plan: PartPlan) -> None:
        cmd = job.cmd
        if offer.ended is not None:  # revoked or expired while the part was written: the receiver knows
            raise BrokerError(offer.ended.code, offer.ended.reason)
        notice = PartNotice(offer.engine_id, offer.request_id, offer.token, job.part,
                            job.part + 1 if cmd.last else 0, True, plan.landed, cmd.aux if cmd.last else b"")
        ack = await self._peers.notify(offer.receiver_address, notice)
        if ack.code:
            raise BrokerError(peer_code(ack.code), f"the receiver refused part {job.part}: {ack.reason}")
        if ack.state is TransferState.FAILED:
            raise BrokerError(Code.ABORTED, f"the receiver's grant has failed: {ack.reason}")
        self._table.progress(record, landed={x.kind: x.pages for x in plan.landed}, runs=plan.runs,
                             nbytes=plan.descriptors.nbytes)

    async def _finish(self, job: _Part, offer: Offer, record: SendRecord) -> None:
        """The last part landed: once every earlier part has too, the request succeeded."""
        job.end_part()
        if not await self._intake.quiesced(offer, job.left()):
            raise BrokerError(Code.DEADLINE_EXCEEDED if job.caller_bound else Code.UNAVAILABLE,
                              "earlier parts of the request did not complete in time")
        if record.state.terminal:
            raise ended_error(record, "request")
        self._table.succeed(record, truncated=offer.coverage.unfilled())
        self._intake.book.end(offer, precondition(f"request {offer.request_id!r} completed already; "
                                                  "no part may follow"))

    async def _fail(self, job: _Part, error: BrokerError) -> None:
        """The part failed after its offer was found: the request fails, and its receiver is told."""
        if job.offer is None or job.record is None:
            return
        job.end_part()
        await self._intake.fail(job.offer, job.record, error.code, error.reason, self._limits.peer_rpc_timeout_s)

    async def close(self) -> None:
        await self._tasks.cancel(self._limits.peer_settle_s)
