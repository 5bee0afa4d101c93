"""Grants offered to this broker by receiving brokers (the decode-initiated flow), as the sender holds them.

The receiving broker's `OfferGrant` puts an `Offer` into the `OfferBook`; the local server's
`Transfer` takes it by request id (waiting a bounded time if it has not arrived); each part it
sends is counted on the offer until the last one; the receiver's `RevokeOffer`, the offer's expiry
or a failed part ends it. Used by the Broker and the sender pipeline, on the event loop only.

Bounds: at most `max_offers` live offers; a Transfer that gave up waiting leaves a note (at most
`max_offers`, for `retention_s`) so that an offer arriving after it is refused at once, and the
receiver's grant fails then instead of at its expiry.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbroker.core.errors import BrokerError, Code, not_found, precondition
from kvbroker.core.model import Component
from kvbroker.core.parts import Coverage
from kvbroker.flows.transfers import TransferRecord

log = logging.getLogger("kvbroker.transfer")


@dataclass(eq=False)
class Offer:
    """A grant offered to this broker: where to write, with which token, and the parts sent so far."""

    receiver_address: str  # the offering broker's peer listener
    receiver_id: str  # the offering broker's identity
    receiver_epoch: int
    engine_id: str  # the receiving engine
    request_id: str
    sender_engine_id: str  # the local engine that may send; empty until a Transfer takes the offer
    granted: dict[Component, np.ndarray]
    token: str
    generation: int  # the receiving engine's registry generation when it offered
    expires_at: float  # loop time
    coverage: Coverage = field(init=False)
    next_part: int = 0
    last_part: int | None = None  # the number of the part marked last, once accepted
    writing: int = 0  # parts accepted whose notice has not been answered
    quiet: asyncio.Event = field(default_factory=asyncio.Event)  # set while writing == 0
    ended: BrokerError | None = None  # why no more part may be sent
    withdrawn: bool = False  # the receiver revoked it (and so needs no word of its end)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    record: TransferRecord | None = None  # the sender's record once an engine holds the offer

    def __post_init__(self) -> None:
        self.coverage = Coverage({k: len(v) for k, v in self.granted.items()})
        self.quiet.set()

    @property
    def components(self) -> tuple[Component, ...]:
        return tuple(self.granted)

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.expires_at - now)

    def begin_part(self, last: bool) -> int:
        """Number the next part; refuses a part after the last one or after the offer ended."""
        if self.ended is not None:
            raise self.ended
        if self.last_part is not None:
            raise precondition(f"request {self.request_id!r}: its last part (part {self.last_part}) was sent "
                               "already; no part may follow it")
        part = self.next_part
        self.next_part += 1
        if last:
            self.last_part = part
        self.writing += 1
        self.quiet.clear()
        return part

    def end_part(self) -> None:
        self.writing -= 1
        if not self.writing:
            self.quiet.set()

    @property
    def done(self) -> bool:
        """Every part up to the last one was sent and answered."""
        return self.last_part is not None and self.writing == 0


class OfferBook:
    """The live offers of one broker, by (request id, sending engine; empty when the receiver named none)."""

    def __init__(self, max_offers: int, *, retention_s: float = 60.0,
                 on_expired: Callable[[Offer], None] | None = None) -> None:
        self._max = max_offers
        self._retention_s = retention_s
        self._on_expired = on_expired
        self._offers: dict[tuple[str, str], Offer] = {}
        self._waiters: dict[str, set[asyncio.Future]] = {}
        self._gave_up: OrderedDict[str, float] = OrderedDict()  # request id → loop time the note goes
        self._closed = False

    def __len__(self) -> int:
        return len(self._offers)

    def __iter__(self):
        return iter(list(self._offers.values()))

    def add(self, offer: Offer) -> None:
        """Hold a new offer; refused when one is live under its key, the book is full, or a Transfer
        for its request id gave up waiting for it."""
        loop = asyncio.get_running_loop()
        self._forget_notes(loop.time())
        if self._gave_up.pop(offer.request_id, None) is not None:
            raise precondition(f"request_id: a Transfer of request {offer.request_id!r} on this broker "
                               "gave up waiting for the offer before it arrived")
        key = (offer.request_id, offer.sender_engine_id)
        if key in self._offers or (offer.request_id, "") in self._offers:
            raise BrokerError(Code.ALREADY_EXISTS,
                              f"request_id: request {offer.request_id!r} was offered to this broker already")
        if len(self._offers) >= self._max:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, f"this broker holds {self._max} offers (max_offers); "
                                                       "no more are taken until some end")
        self._offers[key] = offer
        offer.timer = loop.call_at(offer.expires_at, self._expire, offer)
        for waiter in self._waiters.pop(offer.request_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    def find(self, request_id: str, engine_id: str) -> Offer | None:
        """The offer a Transfer of `engine_id` would take, without waiting."""
        return self._offers.get((request_id, engine_id)) or self._offers.get((request_id, ""))

    async def take(self, request_id: str, engine_id: str, timeout: float) -> Offer:
        """The offer for `request_id` that `engine_id` may send, waiting up to `timeout` for it.
        An offer that named no engine becomes this engine's."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._closed:
                raise BrokerError(Code.UNAVAILABLE, "broker is shutting down and accepts no new requests")
            offer = self.find(request_id, engine_id)
            if offer is not None:
                if not offer.sender_engine_id:
                    del self._offers[(request_id, "")]
                    offer.sender_engine_id = engine_id
                    self._offers[(request_id, engine_id)] = offer
                return offer
            left = deadline - loop.time()
            if left <= 0:
                self._note_gave_up(request_id, loop.time())
                raise not_found(f"request_id: no offer for request {request_id!r} reached this broker within "
                                f"{timeout:.3f}s (offer_wait_s, or the call's deadline); the receiver's "
                                "ExpectTransfer must name this broker as sender_address")
            waiter = loop.create_future()
            self._waiters.setdefault(request_id, set()).add(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), left)
            except TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(request_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[request_id]

    def by_receiver(self, receiver_id: str, engine_id: str, request_id: str) -> Offer | None:
        """The live offer a receiving broker's engine made for `request_id`."""
        for (rid, _), offer in self._offers.items():
            if rid == request_id and offer.engine_id == engine_id and offer.receiver_id == receiver_id:
                return offer
        return None

    def end(self, offer: Offer, error: BrokerError) -> None:
        """No part may be sent any longer; the offer leaves the book (its holders keep it)."""
        if offer.ended is None:
            offer.ended = error
        if offer.timer is not None:
            offer.timer.cancel()
            offer.timer = None
        key = (offer.request_id, offer.sender_engine_id)
        if self._offers.get(key) is offer:
            del self._offers[key]

    def _expire(self, offer: Offer) -> None:
        offer.timer = None
        self.end(offer, BrokerError(Code.DEADLINE_EXCEEDED, f"grant {offer.request_id!r} expired"))
        if self._on_expired is not None:
            self._on_expired(offer)

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
