"""Grants offered to this broker by receiving brokers (the decode-initiated flow), as the sender holds them.

The receiving broker's `OfferGrant` puts an `Offer` into the `OfferBook`; the local server's
`Transfer` takes it by request id *and receiver* (the offering broker's identity, which a part
names in `receiver_broker_id`; a request id alone is a guess anyone can make), waiting a bounded
time if it has not arrived; each part it sends is counted on the offer until the last one; the
receiver's `RevokeOffer`, the offer's expiry or a failed part ends it. Used by the Broker and the
sender pipeline, on the event loop only. The `Offer` itself is the send side of a request's
record (records.py), where the record that a part took it for points back at it.

Offers are keyed by (request id, receiver identity, sending engine; empty when the receiver named
none): two receivers' offers of one request id never collide, and a part that names no receiver
takes an offer only while exactly one could match. Once a part took one, the other receivers'
offers of that request for that engine end (they lost).

Bounds (`OfferQuota`), per peer and in total, checked before an offer's page arrays
are built (`admit`) and again when it is kept (`add`): offers held, page ids held, bytes held (the
page arrays plus OFFER_OVERHEAD_BYTES each); RESOURCE_EXHAUSTED names the setting. A Transfer that
gave up waiting, or a CancelTransfer that waited for the offer (offer_wait_ms) and found none,
leaves a note (at most `max_offers`, for `retention_s`) so that an offer arriving after it is
refused at once, and the receiver's grant fails then instead of at its expiry. A peer is a
PeerIdentity's quota_key: a certified identity, or without mutual TLS the host the offers come from,
whatever broker ids it claims.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvbroker.core.errors import BrokerError, Code, not_found, precondition
from kvbroker.flows.records import Offer

log = logging.getLogger("kvbroker.transfer")


OFFER_OVERHEAD_BYTES = 4096  # what one offer holds beside its page arrays: the Offer, its record, ids, timer


@dataclass(frozen=True)
class OfferQuota:
    """What the offers of one peer (PeerIdentity.quota_key), and of all together, may hold (settings of the
    same names)."""

    max_offers: int = 65536
    max_offers_per_peer: int = 4096
    max_offer_pages: int = 1 << 24
    max_offer_pages_per_peer: int = 1 << 22
    max_offer_bytes: int = 256 << 20
    max_offer_bytes_per_peer: int = 64 << 20


@dataclass
class _Held:
    offers: int = 0
    pages: int = 0
    nbytes: int = 0


def _quota_key(offer: Offer) -> str:
    return offer.quota_key or offer.receiver_id


def offer_bytes(pages: int) -> int:
    """What an offer of `pages` page ids holds: its int64 page arrays and its fixed part."""
    return pages * 8 + OFFER_OVERHEAD_BYTES


class OfferBook:
    """The live offers of one broker, by (request id, receiver identity, sending engine or "")."""

    def __init__(self, quota: OfferQuota | int, *, retention_s: float = 60.0,
                 on_expired: Callable[[Offer], None] | None = None) -> None:
        self._quota = quota if isinstance(quota, OfferQuota) else OfferQuota(max_offers=quota)
        self._max = self._quota.max_offers
        self._retention_s = retention_s
        self._on_expired = on_expired
        self._offers: dict[tuple[str, str, str], Offer] = {}
        self._held: dict[str, _Held] = {}  # per peer (an offer's quota key)
        self._total = _Held()
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._gave_up: OrderedDict[str, float] = OrderedDict()  # request id → loop time the note goes
        self._closed = False

    def __len__(self) -> int:
        return len(self._offers)

    def __iter__(self) -> Iterator[Offer]:
        return iter(list(self._offers.values()))

    def held(self, peer: str | None = None) -> tuple[int, int, int]:
        """(offers, page ids, bytes) held for one peer (an offer's quota key), or in total."""
        held = self._total if peer is None else self._held.get(peer, _Held())
        return held.offers, held.pages, held.nbytes

    def admit(self, peer: str, pages: int) -> None:
        """Whether one more offer of `pages` page ids from `peer` (its quota key) fits; RESOURCE_EXHAUSTED
        naming the setting it would break. Called before the offer's page arrays are built, and by `add`."""
        q, mine, total = self._quota, self._held.get(peer, _Held()), self._total
        nbytes = offer_bytes(pages)
        for value, limit, name, what in (
                (mine.offers + 1, q.max_offers_per_peer, "max_offers_per_peer", "offers"),
                (mine.pages + pages, q.max_offer_pages_per_peer, "max_offer_pages_per_peer", "page ids in offers"),
                (mine.nbytes + nbytes, q.max_offer_bytes_per_peer, "max_offer_bytes_per_peer", "bytes of offers"),
                (total.offers + 1, q.max_offers, "max_offers", "offers"),
                (total.pages + pages, q.max_offer_pages, "max_offer_pages", "page ids in offers"),
                (total.nbytes + nbytes, q.max_offer_bytes, "max_offer_bytes", "bytes of offers")):
            if value > limit:
                whose = peer[:160] if name.endswith("_per_peer") else "this broker"
                raise BrokerError(Code.RESOURCE_EXHAUSTED,
                                  f"pages: {whose} would hold {value} {what}, over the limit of {limit} ({name}); "
                                  "no more are taken until some end")

    def _count(self, offer: Offer, sign: int) -> None:
        pages = sum(len(v) for v in offer.granted.values())
        key = _quota_key(offer)
        mine = self._held.setdefault(key, _Held())
        for held in (mine, self._total):
            held.offers += sign
            held.pages += sign * pages
            held.nbytes += sign * offer_bytes(pages)
        if not mine.offers:
            del self._held[key]

    def add(self, offer: Offer) -> None:
        """Hold a new offer; refused when that receiver has one live for the request and engine (or
        one naming no engine), a quota is full, or a Transfer or cancel for its request id gave up waiting."""
        loop = asyncio.get_running_loop()
        self._forget_notes(loop.time())
        if self._gave_up.pop(offer.request_id, None) is not None:
            raise precondition(f"request_id: the sender of request {offer.request_id!r} on this broker "
                               "gave up waiting for the offer before it arrived (a Transfer or a CancelTransfer "
                               "found none within offer_wait_s)")
        rid, receiver, engine = offer.request_id, offer.receiver_id, offer.sender_engine_id
        taken = [k for k in self._offers
                 if k[0] == rid and k[1] == receiver and (not engine or not k[2] or k[2] == engine)]
        if taken:
            raise BrokerError(Code.ALREADY_EXISTS,
                              f"request_id: request {rid!r} was offered to this broker already by {receiver[:128]!r}")
        self.admit(_quota_key(offer), sum(len(v) for v in offer.granted.values()))
        self._offers[(rid, receiver, engine)] = offer
        self._count(offer, +1)
        offer.timer = loop.call_at(offer.expires_at, self._expire, offer)
        for waiter in self._waiters.pop(rid, ()):
            if not waiter.done():
                waiter.set_result(None)

    def _candidates(self, request_id: str, engine_id: str, receiver_id: str) -> list[Offer]:
        """The live offers a Transfer of `engine_id` could take; one naming the engine before one
        naming none, per receiver."""
        by_receiver: dict[str, Offer] = {}
        for (rid, receiver, engine), offer in self._offers.items():
            if rid != request_id or (receiver_id and receiver != receiver_id) or engine not in (engine_id, ""):
                continue
            if receiver not in by_receiver or engine:
                by_receiver[receiver] = offer
        return list(by_receiver.values())

    def find(self, request_id: str, engine_id: str, receiver_id: str = "") -> Offer | None:
        """The offer a Transfer of `engine_id` would take, without waiting; FAILED_PRECONDITION while,
        with no receiver named, offers of several receivers could match."""
        found = self._candidates(request_id, engine_id, receiver_id)
        if len(found) > 1:
            raise precondition(f"receiver_broker_id: {len(found)} receiving brokers offered request {request_id!r} "
                               "to this broker; name the receiver whose offer this part is for")
        return found[0] if found else None

    async def take(self, request_id: str, engine_id: str, timeout: float, receiver_id: str = "") -> Offer:
        """The offer for `request_id` from `receiver_id` (any one receiver's when empty, see find) that
        `engine_id` may send, waiting up to `timeout` for it. An offer that named no engine becomes
        this engine's."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._closed:
                raise BrokerError(Code.UNAVAILABLE, "broker is shutting down and accepts no new requests")
            offer = self.find(request_id, engine_id, receiver_id)
            if offer is not None:
                if not offer.sender_engine_id:
                    del self._offers[(request_id, offer.receiver_id, "")]
                    offer.sender_engine_id = engine_id
                    self._offers[(request_id, offer.receiver_id, engine_id)] = offer
                return offer
            left = deadline - loop.time()
            if left <= 0:
                self._note_gave_up(request_id, loop.time())
                whose = f" from {receiver_id[:128]!r}" if receiver_id else ""
                raise not_found(f"request_id: no offer for request {request_id!r}{whose} reached this broker within "
                                f"{timeout:.3f}s (offer_wait_s, or the call's deadline); the receiver's "
                                "ExpectTransfer must name this broker as sender_address")
            await self.arrival(request_id, left)

    async def arrival(self, request_id: str, timeout: float) -> bool:
        """Return once an offer for `request_id` is added, or after `timeout`: True; False at once
        when the book is closed (nothing will arrive), so that a waiting loop ends."""
        if self._closed:
            return False
        if timeout <= 0:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(request_id, set()).add(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            pass
        finally:
            waiters = self._waiters.get(request_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[request_id]
        return not self._closed

    def rivals(self, offer: Offer) -> list[Offer]:
        """Other receivers' live offers of the same request that the same engine could have taken."""
        return [o for (rid, receiver, engine), o in self._offers.items()
                if rid == offer.request_id and receiver != offer.receiver_id
                and engine in (offer.sender_engine_id, "")]

    def by_receiver(self, receiver_id: str, engine_id: str, request_id: str) -> Offer | None:
        """The live offer a receiving broker's engine made for `request_id`."""
        for (rid, receiver, _), offer in self._offers.items():
            if rid == request_id and receiver == receiver_id and offer.engine_id == engine_id:
                return offer
        return None

    def end(self, offer: Offer, error: BrokerError) -> None:
        """No part may be sent any longer; the offer leaves the book (its holders keep it)."""
        if offer.ended is None:
            offer.ended = error
        if offer.timer is not None:
            offer.timer.cancel()
            offer.timer = None
        key = (offer.request_id, offer.receiver_id, offer.sender_engine_id)
        if self._offers.get(key) is offer:
            del self._offers[key]
            self._count(offer, -1)

    def _expire(self, offer: Offer) -> None:
        offer.timer = None
        self.end(offer, BrokerError(Code.DEADLINE_EXCEEDED, f"grant {offer.request_id!r} expired"))
        if self._on_expired is not None:
            self._on_expired(offer)

    def refuse_later(self, request_id: str) -> None:
        """A sender gave up on the request before its offer came (a cancel that waited for it): an
        offer arriving later is refused, so its receiver fails at once rather than at its expiry."""
        self._note_gave_up(request_id, asyncio.get_running_loop().time())

    def _note_gave_up(self, request_id: str, now: float) -> None:
        self._gave_up[request_id] = now + self._retention_s
        self._gave_up.move_to_end(request_id)
        while len(self._gave_up) > self._max:
            self._gave_up.popitem(last=False)

    def _forget_notes(self, now: float) -> None:
        while self._gave_up:
            request_id, until = next(iter(self._gave_up.items()))
            if until > now:
                break
            del self._gave_up[request_id]

    def close(self) -> list[Offer]:
        """End every offer (the broker stops); returns them for their receivers to be told."""
        self._closed = True
        offers = list(self._offers.values())
        for offer in offers:
            self.end(offer, BrokerError(Code.UNAVAILABLE, "broker shut down before the request completed"))
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        return offers
