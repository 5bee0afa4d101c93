"""The offered flow's intake on the sender side: grants receivers offer to this broker, until they end.

Called by the Broker (the façade):
- `admit`, `receive_offer` (PeerService OfferGrant): the offer's quotas checked before it is built
  and none taken from this broker itself; the offer checked and kept in the OfferBook; one that
  names its engine becomes that engine's PENDING record at once (the server can watch it), and the
  handshake with the receiver is made ahead, so that no part waits for it.
- `revoke` (PeerService RevokeOffer): the receiver revokes its offer: the offer ends, the record
  fails with the receiver's code, and the answer waits (bounded) until no write into it runs.
- `abort`: the local server cancels (or the engine goes, or the broker drains): the request fails
  (`fail`, the one way an offered request fails here, a failed part's too), and it returns once no
  write runs.
- `held` (WatchTransfer, CancelTransfer): the engine's record of a request, waiting (bounded) for
  an offer still on its way: the local server may learn of the request before its offer lands.
- `end_all`, `close`: the broker stops.
The parts written into the offers are the PartSender's (part_sender.py), which takes offers from
`book`, the record each feeds from `record_for` (the other receivers' offers of the request end
there), and reaches the receiver through `session_for` (dialled as the offering identity).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvbroker.core.errors import BrokerError, Code, clip, invalid, peer_code, precondition, same_token
from kvbroker.core.identity import PeerIdentity
from kvbroker.core.tasks import OwnedTasks
from kvbroker.core.validation import registered_pages
from kvbroker.flows.offers import OfferBook, OfferQuota
from kvbroker.flows.records import Offer, SendRecord, TransferRecord
from kvbroker.flows.registry import Registry
from kvbroker.flows.transfers import TransferTable
from kvbroker.peers.link import GrantOffer, PartNotice, PeerLink, PeerSession

if TYPE_CHECKING:
    from kvbroker.flows.limits import Limits

log = logging.getLogger("kvbroker.transfer")


class OfferIntake:
    def __init__(self, registry: Registry, table: TransferTable, peers: PeerLink, limits: Limits,
                 broker_id: str = "", peer_address: str = "") -> None:
        self._registry = registry
        self._table = table
        self._peers = peers
        self._limits = limits
        self._broker_id = broker_id  # ours: an offer from ourselves is refused
        self._peer_address = peer_address
        quota = OfferQuota(limits.max_offers, limits.max_offers_per_peer, limits.max_offer_pages,
                           limits.max_offer_pages_per_peer, limits.max_offer_bytes, limits.max_offer_bytes_per_peer)
        self.book = OfferBook(quota, on_expired=self._expired)
        self._tasks = OwnedTasks()

    def admit(self, identity: PeerIdentity, pages: int) -> None:
        """Whether an offer of `pages` page ids from this peer fits its quotas, before it is built."""
        self._refuse_own(identity, "")
        self.book.admit(identity.quota_key, pages)

    def _refuse_own(self, identity: PeerIdentity, address: str) -> None:
        """A broker never writes into its own engines through a peer handshake: no offer from itself."""
        if identity.name == self._broker_id or (address and address == self._peer_address):
            raise BrokerError(Code.PERMISSION_DENIED,
                              f"broker_id: an offer from {identity.name[:128]!r} at {address[:128] or 'its address'} "
                              "names this broker itself as the receiver; a broker never writes into its own "
                              "engines through a peer")

    def receive_offer(self, identity: PeerIdentity, offer: GrantOffer, epoch: int) -> None:
        """Keep an offer; refused (and nothing kept) when it cannot be written here."""
        self._refuse_own(identity, offer.peer_address)
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
                     loop.time() + offer.remaining_s, dict(offer.src_offsets), quota_key=identity.quota_key)
        self.book.add(held)
        if engine is not None and not self._held_by_rival(engine.engine_id, offer.request_id):
            try:
                self.attach(held, engine.engine_id)
            except BrokerError:
                self.book.end(held, precondition("offer refused"))
                raise
        self._tasks.spawn(self._prefetch(held), f"handshake ahead {offer.request_id}")

    async def held(self, engine_id: str, request_id: str, wait_s: float) -> TransferRecord:
        """The engine's record of the request, waiting up to `wait_s` (at most offer_wait_s) for the
        receiver's offer naming the engine to land; NOT_FOUND after. A sender may learn of a request
        before the offer reaches its broker (SGLang: decode's metadata frame travels beside it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, self._limits.offer_wait_s)
        while self._table.find(engine_id, request_id) is None and (left := deadline - loop.time()) > 0:
            if not await self.book.arrival(request_id, left):
                break  # the broker stops: no offer will land
        return self._table.get(engine_id, request_id)

    def _held_by_rival(self, engine_id: str, request_id: str) -> bool:
        """Whether the engine's live record of the request feeds another receiver's offer (which a
        part naming this one's receiver may still take it from)."""
        record = self._table.find_as(SendRecord, engine_id, request_id)
        return record is not None and not record.state.terminal and record.offer is not None

    def record_for(self, offer: Offer, engine_id: str) -> SendRecord:
        """The sender record the offer a part took feeds: its own, the engine's record taken over from
        another receiver's offer no part has written yet (FAILED_PRECONDITION once one has), or a new
        one. The other receivers' offers of the request for this engine end: the part chose its
        receiver, and they are told."""
        record = offer.record
        if record is None:
            held = self._table.find_as(SendRecord, engine_id, offer.request_id)
            if held is not None and not held.state.terminal and held.offer is not None:
                rival = held.offer
                if rival.next_part:
                    raise precondition(f"receiver_broker_id: request {offer.request_id!r} is being sent to "
                                       f"{rival.receiver_id!r} already; a part for {offer.receiver_id!r} cannot "
                                       "join it")
                self._table.feed(held, offer)
                record = held
            else:
                record = self.attach(offer, engine_id)
        for rival in self.book.rivals(offer):
            self.book.end(rival, precondition(f"request {offer.request_id!r}: the sender's part is for another "
                                              "receiver"))
            self._tasks.spawn(self._tell_failed(rival, int(Code.FAILED_PRECONDITION),
                                                "the sender's part named another receiver for this request"),
                              f"rival offer {offer.request_id}")
        return record

    def attach(self, offer: Offer, engine_id: str) -> SendRecord:
        """The sender's record of `offer` on engine `engine_id`, fed by its parts."""
        return self._table.add_send(engine_id, offer.request_id, offer.components, offer=offer)

    async def session_for(self, offer: Offer, timeout: float) -> PeerSession:
        """The receiver's engine; a cached handshake from another epoch or generation than the
        offer's is refreshed. The broker there must be the one that offered."""
        address, engine_id, expect = offer.receiver_address, offer.engine_id, offer.receiver_id
        session = await self._peers.session(address, engine_id, refresh=False, timeout=timeout, expect=expect)
        if (session.epoch, session.generation) != (offer.receiver_epoch, offer.generation):
            session = await self._peers.session(address, engine_id, refresh=True, timeout=timeout, expect=expect)
        if session.broker_id != offer.receiver_id:
            raise BrokerError(Code.ABORTED, f"the broker at {address} is {session.broker_id!r}, not "
                                            f"{offer.receiver_id!r} that offered grant {offer.request_id!r}")
        return session

    async def _prefetch(self, offer: Offer) -> None:
        try:
            await self.session_for(offer, self._limits.peer_rpc_timeout_s)
        except (BrokerError, TimeoutError) as exc:
            log.debug("handshake ahead of request %s with %s: %s", offer.request_id, offer.receiver_address, exc)

    def _expired(self, offer: Offer) -> None:
        if offer.record is not None:
            self._table.fail(offer.record, Code.DEADLINE_EXCEEDED,
                             f"grant expired: the offer of {offer.request_id!r} ran out before its last part")

    def _find_offer(self, receiver_id: str, engine_id: str, request_id: str) -> Offer | None:
        """A receiver's offer, live in the book or ended but still held by its record."""
        live = self.book.by_receiver(receiver_id, engine_id, request_id)
        if live is not None:
            return live
        for record in self._table.with_request_id(SendRecord, request_id):
            offer = record.offer
            if offer is not None and offer.engine_id == engine_id and offer.receiver_id == receiver_id:
                return offer
        return None

    async def revoke(self, identity: PeerIdentity, engine_id: str, request_id: str, token: str, code: int,
                     reason: str, wait_s: float) -> bool:
        offer = self._find_offer(identity.name, engine_id, request_id)
        if offer is None:
            return True  # nothing of it here: nothing writes into it
        if not same_token(token, offer.token):
            raise BrokerError(Code.PERMISSION_DENIED, "offer_token: does not match the offer")
        reason = clip(reason) or "no reason given"
        offer.revoked = True
        self.book.end(offer, precondition(f"the receiver revoked grant {request_id!r}: {reason}"))
        if offer.record is not None:
            self._table.fail(offer.record, peer_code(code),
                             f"the receiver {identity.name!r} revoked the grant: {reason}")
        return await self.quiesced(offer, wait_s)

    @staticmethod
    async def quiesced(offer: Offer, wait_s: float) -> bool:
        """Wait (bounded) until no part of `offer` is being written; False if some still is."""
        try:
            await asyncio.wait_for(offer.quiesced.wait(), wait_s)
            return True
        except TimeoutError:
            return False

    async def fail(self, offer: Offer, record: SendRecord, code: Code, reason: str, wait_s: float) -> bool:
        """Fail an offered request: its offer ends, and once no write into it runs (bounded by
        `wait_s`: the receiver reuses its pages once told) its receiver is told. False when the
        record had ended already."""
        if not self._table.fail(record, code, reason):
            return False
        self.book.end(offer, precondition(f"request {record.request_id!r} has failed: {reason}"))
        await self.quiesced(offer, wait_s)
        await self._tell_failed(offer, record.code, record.reason)
        return True

    async def abort(self, record: SendRecord, offer: Offer, code: Code, reason: str, wait_s: float) -> int:
        """Fail an offered request here (the local server's cancel, its engine gone, the drain)."""
        return int(await self.fail(offer, record, code, reason, wait_s))

    async def end_all(self, code: Code, reason: str) -> None:
        """The broker stops: every offer it still holds ends, and each receiver is told at once rather
        than left to its grant's expiry (each told within peer_rpc_timeout_s; an offer whose request a
        Transfer had named was aborted with it already)."""
        offers = [offer for offer in self.book if offer.ended is None]
        for offer in offers:
            self.book.end(offer, BrokerError(code, reason))
        await asyncio.gather(*(self._tell_failed(offer, int(code), reason) for offer in offers))

    async def _tell_failed(self, offer: Offer, code: int, reason: str) -> None:
        if offer.revoked:
            return  # the receiver revoked it: it knows
        notice = PartNotice(offer.engine_id, offer.request_id, offer.token, offer.next_part, 0, False,
                            code=code, reason=reason)
        try:
            await asyncio.wait_for(self._peers.notify(offer.receiver_address, notice),
                                   self._limits.peer_rpc_timeout_s)
        except (BrokerError, TimeoutError) as exc:
            log.debug("could not tell %s that %s failed: %s", offer.receiver_address, offer.request_id, exc)

    async def close(self) -> None:
        for offer in self.book.close():
            if offer.record is not None:
                self._table.fail(offer.record, Code.UNAVAILABLE, "broker shut down before the request completed")
        await self._tasks.cancel(self._limits.peer_settle_s)
