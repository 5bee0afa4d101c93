"""ReceivingRequest: the decode side of one request, on an EngineLink.

    request = ReceivingRequest(link, request_id, on_change=...)
    request.grant(pages, sender_address=..., sender_engine_id=..., expiry_s=..., accept_aux=fn)
        engine thread: offer the grant to the sender's broker and follow it to its end, one command
        (the grant's answer, then its end: no message for a landed part). On SUCCEEDED
        `accept_aux(aux)` takes the sender's aux bytes (an exception it raises, AuxError or
        ValueError, fails the request with its words) before the phase says so
    request.cancel(reason)      see request.py; it waits (bounded) for the grant's own call first, so
                                that what the call made is cancelled too
    request.aux                 the aux bytes of a SUCCEEDED request

Phases: OPEN -> WAITING (offered, PENDING) -> SUCCEEDED | FAILED. No TRANSFERRING: a landed part
costs no message (the engines' decode sides act on the end only).
`holding`: any cancel not yet answered, since once offered any part may write the pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Mapping

import numpy as np

from kvbroker_client.adapter.phases import failure_of
from kvbroker_client.adapter.request import Request
from kvbroker_client.errors import BrokerError, DeadlineExceeded
from kvbroker_client.model import Component, TransferStatus

log = logging.getLogger(__name__)


class ReceivingRequest(Request):
    role = "receiving"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aux = b""
        self._accept_aux: Callable[[bytes], object] | None = None
        self._granting: asyncio.Future | None = None  # the grant's answer (its first status), on the loop

    def grant(self, pages: Mapping[Component, np.ndarray], *, sender_address: str, sender_engine_id: str = "",
              expiry_s: float | None = None, accept_aux: Callable[[bytes], object] | None = None,
              src_offsets: Mapping[Component, int] | None = None) -> concurrent.futures.Future:
        """Offer the grant to the sender's broker and follow it (a task of the link's loop).
        `src_offsets`: per component, the sender's page (by position in its sequence) that lands on
        the grant's first entry, where the receiver holds the pages before it (its prefix cache)."""
        self.offered = True
        self._accept_aux = accept_aux
        self._task = self.link.spawn(self._grant_and_follow(dict(pages), sender_address, sender_engine_id, expiry_s,
                                                            dict(src_offsets or {})),
                                     name=f"offer {self.request_id}")
        return self._task

    async def _grant_and_follow(self, pages, sender_address: str, sender_engine_id: str,
                                expiry_s: float | None, src_offsets: dict[Component, int]) -> None:
        # One command: the grant, then its end. A cancel does not cut it before the grant's answer
        # (the broker may have made the grant already): it waits for `_granting` first, then cancels
        # what the grant made.
        client, settings = self.link.client, self.link.settings
        assert client is not None, "the link is not open"
        granting: asyncio.Future[TransferStatus] = asyncio.get_running_loop().create_future()
        self._granting = granting
        # A dict display: BrokerClient's Mapping[ComponentLike, int] takes no dict[Component, int] (a
        # Mapping's key type is invariant).
        statuses = client.expect_and_watch(
            self.link.engine_id, self.request_id, pages, sender_address=sender_address,
            sender_engine_id=sender_engine_id, expiry_s=expiry_s, timeout=settings.call_timeout_s,
            watch_timeout=settings.watch_timeout_s, src_offsets={k: v for k, v in src_offsets.items()} or None)
        try:
            async with contextlib.aclosing(statuses):
                async for status in statuses:
                    if not granting.done():
                        granting.set_result(status)
                    self.apply(status)
                    if status.state.terminal:
                        return
        except DeadlineExceeded:
            if granting.done():  # the watch's deadline (a long wait): watch again
                await self.follow(terminal_only=True, offer_wait_s=0.0, lost="its grant")
                return
            self.fail(f"kvbroker DEADLINE_EXCEEDED: no answer to the grant of request {self.request_id} within "
                      f"{settings.call_timeout_s:g}s", DeadlineExceeded.code)
        except BrokerError as exc:
            self._fail(failure_of(exc))
        except Exception as exc:  # noqa: BLE001 - a bug must fail the request, not strand it
            log.exception("kvbroker: grant of request %s", self.request_id)
            self.fail(f"kvbroker client error: {exc!r}")
        finally:
            if not granting.done():
                granting.cancel()

    async def _before_cancel(self) -> None:
        if self._granting is not None:
            await asyncio.wait([self._granting], timeout=self.link.settings.call_timeout_s)

    def _succeeded(self, status: TransferStatus) -> None:
        if self._accept_aux is not None:
            try:
                self._accept_aux(status.aux)
            except ValueError as exc:
                self.fail(f"kvbroker aux: {exc}")
                return
        self.aux = status.aux
        super()._succeeded(status)

    @property
    def holding(self) -> bool:
        return self.cancelling
