"""What the sending and the receiving request share: the phase, the failure, the watch, the cancel.

A request is a small state machine on an EngineLink's loop. The engine's thread only starts work
(`cancel`, and each role's own calls) and reads `phase`, `failure`, `holding`; transitions run on the
loop and call `on_change(request)` there, once per change. The broker's word is the only source of
a phase: a watch's status, a call's reply, the cancel's answer.

    offered     the broker may hold a record of it: only then does a cancel go to the broker
    cancel()    ask the broker to end it, once; its answer (no write into its pages runs any more)
                resolves `quiesced`; a request the broker never held is quiesced at once
    holding     a cancel is running and a write may still touch the engine's pages: the engine must
                not reuse them yet (each role says which writes count)
    when_quiesced(fn)   fn() once nothing writes into the request's pages (wait_quiesced: blocking)
    when_ended(fn)      fn(request) once it is terminal and its cancel, if any, answered: the engine may
                        take its pages back (what an engine that polls for finished requests reports)
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

from kvbroker_client.adapter.link import EngineLink
from kvbroker_client.adapter.phases import PHASE_OF_STATE, Failure, Phase, failure_of
from kvbroker_client.errors import BrokerError, DeadlineExceeded, NotFound
from kvbroker_client.model import TransferState, TransferStatus

log = logging.getLogger(__name__)


class Request:
    role = ""  # "sending" or "receiving": log lines and the failure texts say which

    def __init__(self, link: EngineLink, request_id: str,
                 on_change: Callable[[Request], None] | None = None) -> None:
        self.link = link
        self.request_id = request_id
        self.phase = Phase.OPEN
        self.failure: Failure | None = None
        self.offered = False
        self._on_change = on_change
        self._lock = threading.Lock()
        self._task: concurrent.futures.Future | None = None  # the watch (and, receiving, the offer before it)
        self._cancel: concurrent.futures.Future | None = None
        self._on_ended: list[Callable[[Request], None]] = []
        self._ended = False

    # -- transitions ----------------------------------------------------------------------------------
    def rise(self, phase: Phase) -> None:
        """Move up to `phase`; never down, never out of a terminal phase."""
        with self._lock:
            if self.phase.terminal or phase <= self.phase:
                return
            self.phase = phase
        self._changed()
        self._check_ended()

    def fail(self, reason: str, code=None) -> None:
        """The request failed (first cause wins; a later code fills one the first cause lacked);
        nothing once it succeeded. The engine calls this for its own failures too."""
        self._fail(Failure(reason, code))

    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self.phase is Phase.SUCCEEDED:
                return
            if self.phase is Phase.FAILED:
                if self.failure is not None and self.failure.code is None and failure.code is not None:
                    self.failure = Failure(self.failure.reason, failure.code)
                return
            self.phase, self.failure = Phase.FAILED, failure
        self._changed()
        if self.offered:
            self.cancel(failure.reason)
        self._check_ended()

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:  # noqa: BLE001 - an adapter's bug must not stop the request's own transitions
                log.exception("kvbroker: on_change of %s request %s", self.role, self.request_id)

    def apply(self, status: TransferStatus) -> None:
        """A status the broker sent (a watch's, a part's reply)."""
        if status.state is TransferState.FAILED:
            self._fail(failure_of(status))
        elif status.state is TransferState.SUCCEEDED:
            self._succeeded(status)
        else:
            self.rise(PHASE_OF_STATE[status.state])

    def _succeeded(self, status: TransferStatus) -> None:
        self.rise(Phase.SUCCEEDED)

    # -- the broker's view -----------------------------------------------------------------------------
    async def follow(self, *, terminal_only: bool, offer_wait_s: float, lost: str) -> None:
        """Watch the request on the broker until it ends (states only; with `terminal_only` the end
        only); watched again past a watch's deadline. `lost` names what NOT_FOUND means was lost."""
        client, settings = self.link.client, self.link.settings
        assert client is not None, "the link is not open"
        while not self.phase.terminal:
            try:
                async for status in client.watch(self.link.engine_id, self.request_id, states_only=True,
                                                 terminal_only=terminal_only, timeout=settings.watch_timeout_s,
                                                 offer_wait_s=offer_wait_s):
                    self.apply(status)
                    if status.state.terminal:
                        return
            except DeadlineExceeded:
                continue  # a long wait (the sender's queue): watch again
            except NotFound:
                if self.watch_again():
                    continue
                self.fail(f"kvbroker NOT_FOUND: this broker has no record of request {self.request_id} ({lost} was "
                          "lost, expired or revoked)", NotFound.code)
                return
            except BrokerError as exc:
                self._fail(failure_of(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug must fail the request, not strand it
                log.exception("kvbroker: watch of %s request %s", self.role, self.request_id)
                self.fail(f"kvbroker client error: {exc!r}")
                return

    def watch_again(self) -> bool:
        """Whether a watch that found no record should look again (a sender waiting for an offer)."""
        return False

    # -- ending ----------------------------------------------------------------------------------------
    def cancel(self, reason: str, *, offer_wait_s: float | None = None,
               unknown_reason: str | None = None) -> concurrent.futures.Future | None:
        """Ask the broker to end the request, once; the broker answers when no write into it runs, and
        its answer is the request's failure (its code, and its reason unless an earlier cause was
        recorded). A broker with no record of it fails it with `unknown_reason` when given. None when
        there is nothing to cancel (never offered, already cancelled, or the link is closed).
        `offer_wait_s`: how long the broker waits for an offer not yet arrived (None: the role's rule)."""
        if offer_wait_s is None:
            offer_wait_s = self._offer_wait_s()
        with self._lock:
            if not self.offered or self._cancel is not None or not self.link.is_open:
                return None
            follower = self._task
            cancel = self._cancel = self.link.spawn(self._cancelled(reason, offer_wait_s, unknown_reason, follower),
                                                    name=f"cancel {self.request_id}")
        # Outside the lock: a cancel that already answered (an engine thread was preempted here) runs
        # the callback at once, on this thread, and _check_ended takes the lock.
        cancel.add_done_callback(lambda _: self._check_ended())
        return cancel

    def _offer_wait_s(self) -> float:
        return 0.0

    async def _before_cancel(self) -> None:
        """What must end before the cancel is sent (receiving: the grant's own call)."""

    async def _cancelled(self, reason: str, offer_wait_s: float, unknown_reason: str | None,
                         follower: concurrent.futures.Future | None) -> None:
        await self._before_cancel()
        if follower is not None:
            follower.cancel()
        client = self.link.client
        assert client is not None, "the link is not open"
        try:
            status = await client.cancel(self.link.engine_id, self.request_id, reason[:512],
                                         timeout=self.link.settings.call_timeout_s, offer_wait_s=offer_wait_s)
        except NotFound:  # never offered here, or gone: nothing writes into it
            if unknown_reason is not None:
                self.fail(unknown_reason)
            else:
                self.fail(f"kvbroker NOT_FOUND: the broker held no record of request {self.request_id} when it was "
                          f"cancelled ({reason})", NotFound.code)
            return
        except BrokerError as exc:
            log.error("kvbroker: cancelling request %s on the broker failed (%s); its pages are released anyway",
                      self.request_id, exc)
            self._fail(failure_of(exc))
            return
        if status.state.terminal:  # FAILED, or it had ended before the cancel came
            self.apply(status)

    @property
    def cancelling(self) -> bool:
        """A cancel was sent and has not answered yet."""
        cancel = self._cancel
        return cancel is not None and not cancel.done()

    @property
    def cancelled(self) -> bool:
        """A cancel was started (it may have answered)."""
        return self._cancel is not None

    @property
    def holding(self) -> bool:
        """A cancel is running and a write may still touch the engine's pages: each role says which
        writes count (SendingRequest, ReceivingRequest)."""
        raise NotImplementedError

    def when_ended(self, fn: Callable[[Request], None]) -> None:
        """Call `fn(request)` once, when the request is over on the broker's word: terminal, and its
        cancel (if one was started) answered. From then on no write touches its pages. On the link's
        loop, or at once if it is over already."""
        with self._lock:
            if not self._ended:
                self._on_ended.append(fn)
                return
        fn(self)

    def _check_ended(self) -> None:
        with self._lock:
            if self._ended or not self.phase.terminal or self.cancelling:
                return
            self._ended, callbacks, self._on_ended = True, self._on_ended, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - one adapter callback must not keep the others from running
                log.exception("kvbroker: when_ended of %s request %s", self.role, self.request_id)

    def wait_quiesced(self, timeout: float) -> None:
        """Block (an engine thread, never the loop) until the cancel answered; TimeoutError after `timeout`."""
        cancel = self._cancel
        if cancel is not None:
            try:
                cancel.result(timeout)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"the cancel of request {self.request_id} did not answer in {timeout:g}s") from None
            except (concurrent.futures.CancelledError, Exception):  # noqa: BLE001 - it answered, or the link closed
                pass

    def when_quiesced(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once nothing can write into the request's pages: now, or when its cancel answers."""
        cancel = self._cancel
        if cancel is None:
            fn()
        else:
            cancel.add_done_callback(lambda _: fn())

    def when_cancelled(self, fn: Callable[[], None]) -> None:
        """Call `fn()` when the cancel answers (not at all if none was started)."""
        if self._cancel is not None:
            self._cancel.add_done_callback(lambda _: fn())

    def stop_watching(self) -> None:
        """The engine forgot the request: end its watch (a cancel, if any, goes on)."""
        task = self._task
        if task is not None:
            task.cancel()

