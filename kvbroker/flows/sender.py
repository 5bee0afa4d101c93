"""The sender pipeline: one Transfer, from its local checks to the receiver's notice.

`Sender.transfer` (called by the Broker) checks the request against the local engine, adds the
sender's record to the TransferTable and runs `_send` as the task that record owns (the Broker's
cancel and drain cancel it there); it returns the request's terminal status. `_send` reads as its
phases, each a short method:

    session  the receiver's engine, from a cached or a new handshake (PeerLink.session)
    rules    every topology rule of topology.py; a failing cached handshake is refreshed once
    claim    the receiver's grant (PeerLink.claim); a changed epoch or generation refreshes the handshake
    plan     page lists → runs → descriptors (planner.plan_transfer, pure)
    write    TRANSFERRING, then the send step both flows share (send_step.write): the engine
             moves the bytes, its segments checked before and after
    notify   CompleteTransfer to the receiver (PeerLink.complete), then SUCCEEDED

Any failure fails the record with the code and message of what raised (send_step.failure); once the grant is claimed,
the receiver is told of the failure too. Only the claimant may fail a grant, with the claim's
token: so a rule's refusal claims the grant before it is told, and the receiver's watchers see the
rule. This is the claimed flow; the offered flow's sender is part_sender.py.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbroker.backends.base import Backend
from kvbroker.core import topology
from kvbroker.core.errors import BrokerError, Code, invalid
from kvbroker.core.model import Component, TransferState
from kvbroker.core.planner import TransferPlan, plan_transfer
from kvbroker.core.validation import check_components, check_identifier, check_page_ids, registered_pages
from kvbroker.flows.records import Grant, SendRecord, TransferStatus
from kvbroker.flows.registry import Registry
from kvbroker.flows.send_step import SendJob, failure, write
from kvbroker.flows.transfers import TransferTable
from kvbroker.memory.mapping import check_segments
from kvbroker.peers.link import PeerLink, PeerSession

if TYPE_CHECKING:
    from kvbroker.flows.limits import Limits

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class TransferCommand:
    request_id: str
    engine_id: str
    peer_address: str
    remote_engine_id: str
    components: tuple[Component, ...]
    src_page_ids: np.ndarray
    dst_page_ids: np.ndarray  # empty: the grant's


@dataclass
class _Send(SendJob):
    """One transfer on its way: what its phases read, and what its failure path needs to know."""

    record: SendRecord
    cmd: TransferCommand
    token: str = ""  # the claim's, once claimed
    reached_peer: bool = False


class Sender:
    def __init__(self, registry: Registry, table: TransferTable, backend: Backend, peers: PeerLink,
                 limits: Limits) -> None:
        self._registry = registry
        self._table = table
        self._backend = backend
        self._peers = peers
        self._limits = limits

    async def transfer(self, cmd: TransferCommand, timeout: float | None) -> TransferStatus:
        """Validate locally, then run the request as a task the table owns; await its outcome."""
        check_identifier(cmd.request_id, "request_id")
        check_identifier(cmd.remote_engine_id, "remote_engine_id")
        if not cmd.peer_address:
            raise invalid("peer_address: the peer broker's address is required")
        engine = self._registry.get(cmd.engine_id)
        check_segments(engine.held, cmd.engine_id)
        components = check_components(cmd.components, "components")
        num_pages = registered_pages(engine.layout, components)
        check_page_ids(cmd.src_page_ids, "src_page_ids", num_pages, self._limits.max_pages_per_request,
                       unique=False)
        if cmd.dst_page_ids.size:
            check_page_ids(cmd.dst_page_ids, "dst_page_ids", np.iinfo(np.int64).max,
                           self._limits.max_pages_per_request, unique=True)
        record = self._table.add_send(cmd.engine_id, cmd.request_id, components, receiver_address=cmd.peer_address)
        job = _Send(cmd.engine_id, engine, *SendJob.budget_for(timeout, self._limits.transfer_timeout_s),
                    record, cmd)
        task = record.run(self._send(job), f"transfer {cmd.engine_id}/{cmd.request_id}")
        await asyncio.shield(task)
        status = record.snapshot()
        if status.state is TransferState.FAILED:
            raise BrokerError(Code(status.code), status.reason)
        return status

    async def _send(self, job: _Send) -> None:
        """Session, rules, claim, plan, write, notify; every way out ends the record."""
        record, cmd = job.record, job.cmd
        try:
            async with asyncio.timeout(job.budget):
                session = await self._session(job)
                session = await self._rules(job, session)
                session, grant = await self._claim(job, session)
                plan = plan_transfer(job.engine.layout, session.engine, record.components, cmd.src_page_ids,
                                     grant.dst_page_ids, max_pages=self._limits.max_pages_per_request)
                await self._write(job, session, grant, plan)
                await self._notify(job, plan)
        except (Exception, asyncio.CancelledError) as exc:
            cancelled = BrokerError(Code(record.code or Code.CANCELLED), record.reason or "transfer was cancelled")
            error = failure(exc, job, "transfer", cmd.request_id, cancelled)
            self._table.fail(record, error.code, error.reason)
        finally:
            if record.state is TransferState.FAILED and job.reached_peer:
                await self._tell_peer_failed(job)

    def _rpc_timeout(self, job: _Send) -> float:
        return job.rpc_timeout(self._limits.peer_rpc_timeout_s)

    async def _handshake(self, job: _Send, *, refresh: bool) -> PeerSession:
        return await self._peers.session(job.cmd.peer_address, job.cmd.remote_engine_id, refresh=refresh,
                                         timeout=self._rpc_timeout(job))

    async def _session(self, job: _Send) -> PeerSession:
        session = await self._handshake(job, refresh=False)
        job.reached_peer = True
        return session

    async def _rules(self, job: _Send, session: PeerSession) -> PeerSession:
        """Check every topology rule; a cached handshake that fails is refreshed once before refusing,
        since the peer engine may have re-registered since."""
        components = job.record.components
        try:
            try:
                topology.check_transfer(job.engine.layout, session.engine, components)
                return session
            except BrokerError:
                fresh = await self._handshake(job, refresh=True)
                if (fresh.epoch, fresh.generation) == (session.epoch, session.generation):
                    raise
                topology.check_transfer(job.engine.layout, fresh.engine, components)
                return fresh
        except BrokerError:
            await self._claim_to_refuse(job, session)
            raise

    async def _claim_to_refuse(self, job: _Send, session: PeerSession) -> None:
        """Claim the grant a rule refused, so that it can be failed with the rule (a grant that will
        not be claimed, say for a component it lacks, just keeps waiting for its sender or expiry)."""
        try:
            await self._claim(job, session)
        except BrokerError as exc:
            log.debug("could not claim refused grant %s: %s", job.cmd.request_id, exc)

    async def _claim(self, job: _Send, session: PeerSession) -> tuple[PeerSession, Grant]:
        """The receiver's grant; when it answers from another epoch or registry generation than the
        handshake's, the handshake is refreshed and the rules checked again."""
        claimed = await self._peers.claim(session, job.cmd.request_id, job.record.components, job.cmd.dst_page_ids,
                                          timeout=self._rpc_timeout(job))
        job.token = claimed.grant.claim_token
        if (claimed.epoch, claimed.generation) != (session.epoch, session.generation):
            session = await self._handshake(job, refresh=True)
            topology.check_transfer(job.engine.layout, session.engine, job.record.components)
        return session, claimed.grant

    async def _write(self, job: _Send, session: PeerSession, grant: Grant, plan: TransferPlan) -> None:
        await write(self._backend, job, session.peer_handle, plan.descriptors,
                    lambda: min(job.left(), grant.remaining_s), lambda: self._table.start(job.record))

    async def _notify(self, job: _Send, plan: TransferPlan) -> None:
        """Tell the receiver what was written; the request succeeds once it agrees."""
        record, cmd, runs = job.record, job.cmd, plan.runs
        self._table.written(record, pages=runs.pages, runs=runs.count, nbytes=plan.descriptors.nbytes,
                            truncated=plan.truncated)
        state = await self._peers.complete(cmd.peer_address, cmd.remote_engine_id, cmd.request_id, job.token,
                                           record.snapshot(), timeout=self._rpc_timeout(job))
        if state is not TransferState.SUCCEEDED:
            raise BrokerError(Code.ABORTED, f"receiver reports the grant as {state.name} after the write")
        self._table.succeed(record, pages=runs.pages, runs=runs.count, nbytes=plan.descriptors.nbytes,
                            truncated=plan.truncated)

    async def _tell_peer_failed(self, job: _Send) -> None:
        record, cmd = job.record, job.cmd
        if not job.token:
            return  # never claimed: the grant is not ours to fail
        try:
            await asyncio.shield(self._peers.complete(cmd.peer_address, cmd.remote_engine_id, cmd.request_id,
                                                      job.token, record.snapshot(),
                                                      timeout=self._limits.peer_rpc_timeout_s))
        except (BrokerError, TimeoutError, asyncio.CancelledError) as exc:
            log.debug("could not tell %s that %s failed: %s", cmd.peer_address, cmd.request_id, exc)
