"""The receiver side: grants, their offers to senders, and what senders report into them.

Called by the Broker (the façade):
- `expect` (ExpectTransfer): a grant of a destination page list per component. With a sender
  address, the grant is offered to that broker (OfferGrant) before the call returns, and only
  that broker may write it; an offer that fails fails the grant.
- `claim`, `complete` (PeerService ClaimGrant, CompleteTransfer): the claimed flow, where the
  sender names this broker. A grant is claimed once, by an admitted peer; only its claimant, with
  the claim's token, may then complete or fail it. Counts come from the grant, not the claim.
- `take_notices` (PeerService NotifyParts): each notice checked against its grant (the offer's
  token, the sender's identity, the landing of parts.py) and applied: pages landed, the last
  part's aux, SUCCEEDED once every part has landed, FAILED when the sender says so. Counts come
  from the grant and this broker's own item_len, never from the sender's figures.
- `fence` (the table's fence): an offered grant failing without its sender (cancelled, expired,
  its engine unregistered, the broker draining) is revoked at the sender (RevokeOffer), which
  answers once no write into it runs; the grant ends FAILED after that answer (transfers.py), and
  `revoked` waits for those ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbroker.core.errors import BrokerError, Code, clip, invalid, not_found, peer_code, precondition, same_token
from kvbroker.core.identity import PeerIdentity
from kvbroker.core.model import Component, TransferState
from kvbroker.core.parts import Landed, Landing, landed_bytes
from kvbroker.core.validation import (
    check_aux,
    check_components,
    check_grant_pages,
    check_identifier,
    check_page_ids,
    check_peer_address,
    check_src_offsets,
    check_unique,
    registered_pages,
)
from kvbroker.flows.records import Grant, GrantRecord, OfferedGrant, TransferRecord, TransferStatus, ended_error
from kvbroker.flows.registry import Engine, Registry
from kvbroker.flows.transfers import TransferTable
from kvbroker.memory.mapping import check_segments
from kvbroker.peers.link import GrantOffer, PartAck, PartNotice, PeerLink

if TYPE_CHECKING:
    from kvbroker.flows.limits import Limits

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class GrantCommand:
    """An ExpectTransfer as the domain sees it."""

    request_id: str
    engine_id: str
    pages: tuple[tuple[Component, np.ndarray], ...]  # destination pages per component
    expiry_ms: int
    sender_address: str = ""  # set: the offered flow
    sender_engine_id: str = ""
    shared: bool = False  # one dst_page_ids list for every component (the claimed flow's form)
    src_offsets: tuple[tuple[Component, int], ...] = ()  # offered grants: the sender's page on entry 0


class Receiver:
    def __init__(self, registry: Registry, table: TransferTable, peers: PeerLink, limits: Limits,
                 peer_address: str) -> None:
        self._registry = registry
        self._table = table
        self._peers = peers
        self._limits = limits
        self._peer_address = peer_address  # ours, where senders reach this broker

    async def expect(self, cmd: GrantCommand) -> TransferStatus:
        check_identifier(cmd.request_id, "request_id")
        engine = self._registry.get(cmd.engine_id)
        check_segments(engine.held, cmd.engine_id)
        max_pages = self._limits.max_pages_per_request
        granted: dict[Component, np.ndarray]
        if cmd.shared:
            components = check_components([kind for kind, _ in cmd.pages], "components")
            ids = cmd.pages[0][1] if cmd.pages else np.empty(0, dtype=np.int64)
            check_page_ids(ids, "dst_page_ids", registered_pages(engine.layout, components), max_pages, unique=True)
            granted = {kind: ids for kind in components}
        else:
            granted = check_grant_pages(engine.layout, cmd.pages, "pages", max_pages)
            if not cmd.sender_address:
                raise invalid("pages: a page list per component is for a grant offered to its sender; set "
                              "sender_address, or give one dst_page_ids list")
        src_offsets = check_src_offsets(cmd.src_offsets, granted, offered=bool(cmd.sender_address),
                                        max_pages=max_pages)
        if cmd.sender_address:
            check_peer_address(cmd.sender_address, "sender_address")
        if cmd.sender_engine_id:
            if not cmd.sender_address:
                raise invalid("sender_engine_id: needs sender_address")
            check_identifier(cmd.sender_engine_id, "sender_engine_id")
        expiry_s = cmd.expiry_ms / 1000 if cmd.expiry_ms else self._limits.default_grant_expiry_s
        if expiry_s > self._limits.max_grant_expiry_s:
            raise invalid(f"expiry_ms: {cmd.expiry_ms} exceeds the limit of "
                          f"{self._limits.max_grant_expiry_s * 1000:.0f}")
        offered = None
        if cmd.sender_address:
            offered = OfferedGrant(cmd.sender_address, cmd.sender_engine_id, secrets.token_hex(16),
                                   Landing(granted, self._limits.max_parts_per_request), src_offsets=src_offsets)
        record = self._table.add_grant(cmd.engine_id, cmd.request_id, granted, expiry_s, offered)
        if offered is not None:
            await self._offer(record, offered, engine.generation, expiry_s)
        return record.snapshot()

    async def _offer(self, record: GrantRecord, offered: OfferedGrant, generation: int, expiry_s: float) -> None:
        """Offer the grant to its sender; the grant fails with the offer."""
        # The offer lives no longer than the grant: what is left of it now, not what was asked for.
        offer = GrantOffer(self._peer_address, record.engine_id, record.request_id, offered.sender_engine_id,
                           dict(record.granted), min(expiry_s, self._table.remaining_s(record)), offered.token,
                           generation, dict(offered.src_offsets))
        failure = None
        try:
            sender_id, epoch = await self._peers.offer(offered.sender_address, offer,
                                                       timeout=self._limits.peer_rpc_timeout_s)
        except BrokerError as exc:
            # The sender answered a refusal: it holds nothing to revoke. Silence (UNAVAILABLE) may hide an
            # offer that arrived, so that one is revoked when the grant fails here.
            failure = BrokerError(exc.code, f"the offer to the sender broker at {offered.sender_address} failed: "
                                            f"{exc.reason}")
            self._table.fail(record, failure.code, failure.reason, sender_stopped=exc.code is not Code.UNAVAILABLE)
        finally:
            offered.offered.set()
        if failure is None:
            if offered.sender_id and offered.sender_id != sender_id:
                self._table.fail(record, Code.PERMISSION_DENIED,
                                 f"the broker at {offered.sender_address} answered as {sender_id!r}, but "
                                 f"{offered.sender_id!r} reported parts of the grant")
            self._table.sender_heard(record, sender_id, epoch)
        if record.state is TransferState.FAILED or record.ending is not None:  # failed, cancelled or expired
            # Only once the grant has ended (its revocation answered, or given up on) does the caller hear
            # of the failure: no page it may reuse then can still be written, and the id is free again.
            await self._table.ended([record], timeout=self._limits.peer_rpc_timeout_s * 2)
            if failure is not None:
                raise failure
            raise BrokerError(peer_code(record.code), record.reason)

    def claim(self, identity: PeerIdentity, engine_id: str, request_id: str, components: tuple[Component, ...],
              dst_page_ids: np.ndarray) -> tuple[Grant, int]:
        engine = self._registry.get(engine_id)
        check_segments(engine.held, engine_id)
        record, granted = _claimable(self._table, engine_id, request_id, components, dst_page_ids)
        grant = self._table.hand_out(record, granted, identity.name)
        return grant, engine.generation

    def complete(self, identity: PeerIdentity, engine_id: str, request_id: str, claim_token: str, *,
                 succeeded: bool, code: int, reason: str, pages: int, runs: int) -> TransferState:
        """The claimant's word on a claimed grant. Only the claimant, with its token, is heard; the
        counts kept are this broker's: a one-sided write shows the receiver nothing, so the pages landed
        are the claimant's figure cut to the pages it claimed (unique, inside the grant), bytes those
        pages times this engine's item_len, and truncated_pages the claimed entries left unfilled."""
        record = self._table.find_as(GrantRecord, engine_id, request_id)
        if record is None:
            self._table.get(engine_id, request_id)  # NOT_FOUND when there is no request at all
            raise invalid(f"request_id: request {request_id!r} on engine {engine_id!r} is not a grant")
        if record.offered is not None:
            raise BrokerError(Code.PERMISSION_DENIED, f"grant {request_id!r} was offered to its sender; only that "
                                                      "broker's part notices complete it")
        if record.state.terminal:
            return record.state
        if not record.claim_token or not claim_token or not same_token(claim_token, record.claim_token):
            raise BrokerError(Code.PERMISSION_DENIED, f"claim_token: does not match the claim of {request_id!r}")
        if identity.name != record.claimant:
            raise BrokerError(Code.PERMISSION_DENIED, f"grant {request_id!r} was claimed by {record.claimant!r}, not "
                                                      f"{identity.name!r}")
        if succeeded:
            engine = self._registry.find(engine_id)
            if engine is not None:
                self._segments_hold(record, engine)
            landed = min(max(pages, 0), record.claimed_pages)
            per_page = 0 if engine is None else sum(engine.layout.components[k].page_bytes
                                                    for k in record.components)
            self._table.succeed(record, pages=landed, runs=min(max(runs, 0), landed), nbytes=landed * per_page,
                                truncated=record.claimed_pages - landed)
        else:
            self._table.fail(record, peer_code(code), f"sender {identity.name!r} failed: {clip(reason)}")
        return record.state

    def take_notices(self, identity: PeerIdentity, notices: list[PartNotice]) -> list[PartAck]:
        return [self._take(identity, notice) for notice in notices]

    def _take(self, identity: PeerIdentity, n: PartNotice) -> PartAck:
        record = self._table.find_as(GrantRecord, n.engine_id, n.request_id)
        offered = None if record is None else record.offered
        if record is None or offered is None:
            return PartAck(None, int(Code.NOT_FOUND),
                           f"no offered grant {n.request_id[:128]!r} on engine {n.engine_id[:128]!r}")
        if not same_token(n.token, offered.token):
            return PartAck(None, int(Code.PERMISSION_DENIED), "offer_token: does not match the grant's offer")
        if offered.sender_id and identity.name != offered.sender_id:
            return PartAck(None, int(Code.PERMISSION_DENIED),
                           f"grant {n.request_id!r} was offered to {offered.sender_id!r}, not {identity.name!r}")
        landing = offered.landing
        if record.settled or landing is None:  # ended, or ending (being revoked at this sender)
            return PartAck(record.state if record.state.terminal else TransferState.FAILED, 0, record.reason)
        if not offered.sender_id:
            self._table.sender_heard(record, identity.name)
        if not n.succeeded:
            self._table.fail(record, peer_code(n.code), f"sender {identity.name!r} failed: {clip(n.reason)}",
                             sender_stopped=True)
            return PartAck(record.state, 0, record.reason)
        try:
            check_aux(n.aux, last=bool(n.parts_total), max_aux_bytes=self._limits.max_aux_bytes)
            engine = self._registry.get(n.engine_id)
            landing.check(n.part, n.parts_total, n.landed)
        except BrokerError as exc:
            # The grant's own sender reported what cannot be: its writes can no longer be trusted.
            self._table.fail(record, Code.ABORTED, f"sender {identity.name!r} reported an impossible part: "
                                                   f"{exc.reason}")
            return PartAck(record.state, int(exc.code), exc.reason)
        try:
            self._segments_hold(record, engine)
        except BrokerError as exc:
            return PartAck(record.state, int(exc.code), exc.reason)
        landing.land(n.part, n.parts_total, n.landed)
        complete = landing.complete
        self._table.progress(record, landed=_by_component(n.landed), runs=0,
                             nbytes=landed_bytes(engine.layout, n.landed), last=complete,
                             aux=bytes(n.aux) if n.parts_total else None)
        if complete:
            self._table.succeed(record, truncated=landing.coverage.unfilled())
        return PartAck(record.state)

    def _segments_hold(self, record: GrantRecord, engine: Engine) -> None:
        """A write may have crossed a segment shrunk meanwhile: its bytes are not there, and the
        grant fails with the cause (memory.check_segments)."""
        try:
            check_segments(engine.held, engine.engine_id)
        except BrokerError as exc:
            self._table.fail(record, exc.code, exc.reason)
            raise

    async def fence(self, record: GrantRecord) -> str:
        """Revoke a failing offered grant at its sender: "" once the sender answered that no write into
        it runs, else why that is not known (the grant fails all the same, its reason saying so)."""
        offered, timeout = record.offered, self._limits.peer_rpc_timeout_s
        if offered is None:  # the table fences offered grants only
            return ""
        try:
            await asyncio.wait_for(offered.offered.wait(), timeout)  # an offer on its way is revoked after it
            if offered.sender_failed:
                return ""
            quiesced = await self._peers.revoke(offered.sender_address, record.engine_id, record.request_id,
                                                offered.token, record.code, record.reason, timeout=timeout)
        except (BrokerError, TimeoutError) as exc:
            message = exc.reason if isinstance(exc, BrokerError) else f"no answer within {timeout:g}s"
            log.warning("could not revoke grant %s at its sender %s: %s", record.request_id,
                        offered.sender_address, message)
            return f"its revocation at the sender {offered.sender_address} failed: {message}"
        if not quiesced:
            log.warning("the sender %s of grant %s still wrote into it when it answered the revocation",
                        offered.sender_address, record.request_id)
            return f"the sender {offered.sender_address} still wrote into it when it answered the revocation"
        return ""

    async def revoked(self, records: list[TransferRecord], timeout: float) -> None:
        """Wait (bounded) until these grants have ended: an offered one once its sender answered."""
        await self._table.ended(records, timeout)


def _by_component(landed: Sequence[Landed]) -> dict[Component, int]:
    pages: dict[Component, int] = {}
    for x in landed:
        pages[x.kind] = pages.get(x.kind, 0) + x.pages
    return pages


def _claimable(table: TransferTable, engine_id: str, request_id: str, components: tuple[Component, ...],
               dst_page_ids: np.ndarray) -> tuple[GrantRecord, np.ndarray]:
    """The claim rules: a grant goes to one sender, once, and only pages of it. Raises without
    changing the grant when refused; else the grant and the pages the claim hands out."""
    record = table.find_as(GrantRecord, engine_id, request_id)
    if record is None:
        if table.find(engine_id, request_id) is None:
            raise not_found(f"request_id: no grant for request {request_id!r} on engine {engine_id!r}")
        raise not_found(f"request_id: request {request_id!r} on engine {engine_id!r} is not a grant")
    if record.state is TransferState.FAILED:
        raise ended_error(record, "grant")
    if record.offered is not None:
        raise BrokerError(Code.PERMISSION_DENIED,
                          f"grant {request_id!r} was offered to the broker at {record.offered.sender_address}; "
                          "only that broker's parts may write it")
    if record.state is not TransferState.PENDING:
        raise BrokerError(Code.PERMISSION_DENIED,
                          f"grant {request_id!r} was already claimed (state {record.state.name})")
    outside = [c.name for c in components if c not in record.components]
    if outside:
        raise BrokerError(Code.PERMISSION_DENIED,
                          f"components: {', '.join(outside)} not in the grant for request {request_id!r}")
    components = components or record.components
    lists = {id(record.granted[c]) for c in components}
    if len(lists) != 1:
        raise precondition(f"grant {request_id!r} has a page list per component; the claimed flow moves one "
                           "list, so only an offered grant (sender_address) can have several")
    granted = record.granted[components[0]]
    if dst_page_ids.size:
        check_unique(dst_page_ids, "dst_page_ids", "a page of the grant is claimed at most once")
        inside = np.isin(dst_page_ids, granted)
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise BrokerError(
                Code.PERMISSION_DENIED,
                f"dst_page_ids[{bad}]: page {int(dst_page_ids[bad])} is outside the grant for request "
                f"{request_id!r}",
            )
        granted = dst_page_ids
    return record, granted
