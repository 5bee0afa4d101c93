"""SendingRequest: the prefill side of one request, on an EngineLink.

    request = SendingRequest(link, request_id, on_change=...)
    request.expect_offer()      watch for the receiver's offer and follow the request to its end
                                (the end only: each part's reply carries the state)
    request.send_when_offered(part, hold_s)   the sender whose engine finished first (vLLM): wait
                                for the offer, watched again until `hold_s`, then send `part` at once
    request.send_part(Part(...))    engine thread: one part, sent in the engine's order; `ready`, the
                                engine's "pages written" wait, runs off the loop first
    request.cancel(reason)      see request.py; once the offer is expected, a sender's cancel waits
                                (call_timeout_s) for an offer still on its way, and cancels it once it lands
    request.refuse_offer(reason)    the engine ended the request before the offer came: refuse it
    request.final, request.succeeded_at     the broker's SUCCEEDED status (bytes moved), and when

Phases: OPEN -> WAITING (never reported by the end-only watch; an adapter that knows the offer is
on its way says so itself) -> SUCCEEDED | FAILED, from the watch or the last part's reply.
`holding` counts only parts: a sender's pages are read by parts alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbroker_client.adapter.phases import Phase, failure_of
from kvbroker_client.adapter.request import Request
from kvbroker_client.errors import BrokerError
from kvbroker_client.model import Component, TransferStatus

log = logging.getLogger(__name__)


@dataclass
class Part:
    """One part of a request: source pages per component, where they land in the grant, and whether it is the last."""

    pages: dict[Component, np.ndarray]
    last: bool
    dst_offsets: Mapping[Component, int] = field(default_factory=dict)
    aux: bytes = b""  # the last part's payload for the receiver
    ready: Callable[[], object] | None = None  # blocks until the engine has written the pages (a thread runs it)
    receiver_broker_id: str = ""  # whose offer the part is for (the receiving broker's id); "" the only one


class SendingRequest(Request):
    role = "sending"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parts_sent = 0  # parts handed to the loop; only they read the request's pages
        self.final: TransferStatus | None = None
        self.succeeded_at: float | None = None  # time.perf_counter() when SUCCEEDED arrived
        self._order: asyncio.Lock | None = None
        self._offer_expected = False
        self._when_offered: Part | None = None
        self._hold_until: float | None = None  # loop time past which a missing offer fails the request

    def expect_offer(self) -> concurrent.futures.Future:
        """Follow the request on the broker, waiting there (call_timeout_s) for an offer still on its way."""
        self._offer_expected = True
        self._task = self.link.spawn(
            self.follow(terminal_only=True, offer_wait_s=self.link.settings.call_timeout_s,
                        lost="the decode broker's offer for it"),
            name=f"watch {self.request_id}")
        return self._task

    def send_when_offered(self, part: Part, hold_s: float) -> concurrent.futures.Future:
        """Watch (states) for the receiver's offer and send `part` once it landed; an offer still
        missing after the broker's wait is watched for again, until `hold_s` from now. A part sent
        before the offer would give up after the broker's offer_wait_s, which may be shorter than the
        receiver's queue; a watch leaves nothing behind when it ends."""
        self._offer_expected = True
        self._when_offered = part
        self.offered = True  # the offer may land at any moment: a cancel must reach the broker

        async def watch() -> None:
            self._hold_until = asyncio.get_running_loop().time() + hold_s
            await self.follow(terminal_only=False, offer_wait_s=self.link.settings.call_timeout_s,
                              lost="the receiver's offer for it")

        self._task = self.link.spawn(watch(), name=f"watch {self.request_id}")
        return self._task

    def rise(self, phase: Phase) -> None:
        super().rise(phase)
        if self.phase >= Phase.WAITING and not self.phase.terminal and self._when_offered is not None:
            part, self._when_offered = self._when_offered, None
            self.send_part(part)

    def watch_again(self) -> bool:
        if self._hold_until is None or self.phase is not Phase.OPEN:
            return False
        return asyncio.get_running_loop().time() < self._hold_until

    def send_part(self, part: Part) -> None:
        """Hand one part to the loop; parts reach the broker in the order they were handed over."""
        self.offered = True
        self.parts_sent += 1
        self.link.spawn(self._send(part), name=f"part {self.request_id}@{dict(part.dst_offsets)}")

    async def _send(self, part: Part) -> None:
        if self._order is None:
            self._order = asyncio.Lock()
        async with self._order:
            if self.phase.terminal or self.cancelled:
                return
            if part.ready is not None:  # the engine may still be writing these pages
                await asyncio.to_thread(part.ready)
            try:
                client = self.link.client
                assert client is not None, "the link is not open"
                # Dict displays: BrokerClient's Mapping[ComponentLike, ...] parameters take no dict[Component, ...]
                # (a Mapping's key type is invariant).
                status = await client.transfer_part(
                    self.link.engine_id, self.request_id, {k: v for k, v in part.pages.items()},
                    dst_offsets={k: v for k, v in part.dst_offsets.items()},
                    last=part.last, aux=part.aux, receiver_broker_id=part.receiver_broker_id,
                    timeout=self.link.settings.call_timeout_s)
            except BrokerError as exc:
                self._fail(failure_of(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug must fail the request, not strand it
                log.exception("kvbroker: part of request %s", self.request_id)
                self.fail(f"kvbroker client error: {exc!r}")
                return
            self.apply(status)

    def _offer_wait_s(self) -> float:
        return self.link.settings.call_timeout_s if self._offer_expected else 0.0

    def _succeeded(self, status: TransferStatus) -> None:
        if self.final is None:
            self.final, self.succeeded_at = status, time.perf_counter()
        super()._succeeded(status)

    def refuse_offer(self, reason: str) -> concurrent.futures.Future | None:
        """The engine ended the request before the receiver's offer reached this broker: cancel the
        offer once it lands (waiting call_timeout_s for it), so the receiver fails now rather than at
        its grant's expiry. Nothing of the request is kept here."""
        self.offered = True
        return self.cancel(reason, offer_wait_s=self.link.settings.call_timeout_s)

    @property
    def holding(self) -> bool:
        return self.cancelling and self.parts_sent > 0
