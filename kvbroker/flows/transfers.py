"""Request lifecycle on one broker: the table of records, their states, grant expiry, claims, watchers.

A record is a request as one broker sees it, keyed by (engine_id, request_id): a `GrantRecord` (the
receiver's side) or a `SendRecord` (the sender's side) over a common core (records.py).
`TransferTable` owns every record, every expiry timer and every watcher queue, and is the one place
a record's state changes; the Receiver, the Sender, the PartSender and the OfferIntake drive those
changes, servicers read snapshots and watch:
- lookup: `get`, `find`, `live`; `find_as` and `with_request_id` give the records of one side only;
- creation: `add_grant` (ExpectTransfer), `add_send` (Transfer, or an offer naming its engine);
  `feed` points a sender's record at the offer its parts write into;
- state changes: `start` (TRANSFERRING), `written` and `progress` (what was written, what landed),
  `succeed`, `fail`, `interrupt` (the claimed flow's sender task cancelled with the cause its
  failure carries); a grant's expiry fails it by itself;
- the receiver's grant: `hand_out`, once, to the sender's ClaimGrant (the Receiver checks the
  claim rules first); an offered grant (`OfferedGrant`) is filled by parts instead, and learns its
  sender's identity through `sender_heard`;
- `watch`: the current state, then every change of state or of the parts landed.
Every state change passes through `_add`, `start`, `progress` or `_end`: there the table tells its
observer (metrics), and `_end` writes the one log line of each request's end, whatever ended it,
and lets go of the request's page lists: an ended record keeps counts only.

A grant offered to a sender that did not end it itself (cancelled, expired, its engine unregistered,
the broker draining, a lying notice) is not FAILED at once: `fail` decides the outcome and runs
`fence` (the revocation at the sender) first, and the record ends once the sender answered that no
write into it runs, or the fence gave up. Meanwhile it is `ending`: it takes no part and no other
end, and its watchers still see it live, so that FAILED, to whoever watches, means no byte of the
grant lands any more.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Protocol, TypeVar

import numpy as np

from kvbroker.core.errors import BrokerError, Code, code_name, not_found
from kvbroker.core.model import Component, TransferState
from kvbroker.core.tasks import OwnedTasks
from kvbroker.flows.records import (
    Aux,
    Grant,
    GrantRecord,
    Offer,
    OfferedGrant,
    SendRecord,
    TransferRecord,
    TransferStatus,
    Watcher,
    ended_error,
)

__all__ = ["Grant", "GrantRecord", "OfferedGrant", "SendRecord", "TransferObserver", "TransferRecord",
           "TransferStatus", "TransferTable", "ended_error"]

log = logging.getLogger("kvbroker.transfer")


class TransferObserver(Protocol):
    def transfer_changed(self, record: TransferRecord) -> None:
        """After each state change of `record`: accepted (PENDING), TRANSFERRING, SUCCEEDED or FAILED."""


R = TypeVar("R", bound=TransferRecord)


class TransferTable:
    """Every live and recently ended request of one broker. Used on the event loop only."""

    def __init__(self, retention_s: float = 300.0, max_ended: int = 10000,
                 clock: Callable[[], float] = time.monotonic, observer: TransferObserver | None = None,
                 fence: Callable[[GrantRecord], Awaitable[str]] | None = None) -> None:
        self._observer = observer
        self._fences = None if fence is None else _Fences(fence, lambda r: self._end(r, TransferState.FAILED))
        self._records: dict[tuple[str, str], TransferRecord] = {}
        self._ended: dict[tuple[str, str], None] = {}  # insertion-ordered, oldest first
        self._retention_s = retention_s
        self._max_ended = max_ended
        self._clock = clock
        self.counts: Counter[str] = Counter()

    def get(self, engine_id: str, request_id: str) -> TransferRecord:
        try:
            return self._records[(engine_id, request_id)]
        except KeyError:
            raise not_found(f"request_id: no request {request_id!r} on engine {engine_id!r}") from None

    def find(self, engine_id: str, request_id: str) -> TransferRecord | None:
        return self._records.get((engine_id, request_id))

    def find_as(self, side: type[R], engine_id: str, request_id: str) -> R | None:
        """The record of the request if it is of that side (GrantRecord, SendRecord), else None."""
        return record if isinstance(record := self._records.get((engine_id, request_id)), side) else None

    def with_request_id(self, side: type[R], request_id: str) -> list[R]:
        """Every record of that side, live or recently ended, of `request_id` on any engine of this broker."""
        return [r for r in self._records.values() if r.request_id == request_id and isinstance(r, side)]

    def live(self, engine_id: str | None = None) -> list[TransferRecord]:
        return [r for r in self._records.values()
                if not r.state.terminal and (engine_id is None or r.engine_id == engine_id)]

    def _add(self, record: R) -> R:
        old = self._records.get(record.key)
        if old is not None and not old.state.terminal:
            raise BrokerError(Code.ALREADY_EXISTS, f"request_id: request {record.request_id!r} "
                                                   f"is already in flight on engine {record.engine_id!r}")
        if old is not None:
            self._ended.pop(old.key, None)
        self._records[record.key] = record
        self.counts[TransferState.PENDING.name] += 1
        if self._observer is not None:
            self._observer.transfer_changed(record)
        return record

    def add_grant(self, engine_id: str, request_id: str, granted: dict[Component, np.ndarray], expiry_s: float,
                  offered: OfferedGrant | None = None) -> GrantRecord:
        """A grant of `granted` (destination pages per component; the claimed flow shares one list
        among its components), failed by itself at `expiry_s`."""
        now = self._clock()
        record = self._add(GrantRecord(request_id, engine_id, tuple(granted), now, granted=granted,
                                       expires_at=now + expiry_s, offered=offered))
        record.timer = asyncio.get_running_loop().call_later(expiry_s, self._expire, record)
        return record

    def remaining_s(self, record: GrantRecord) -> float:  # what is left of a grant's lifetime, seconds
        return max(0.0, record.expires_at - self._clock())

    def add_send(self, engine_id: str, request_id: str, components: tuple[Component, ...],
                 receiver_address: str = "", offer: Offer | None = None) -> SendRecord:
        """A sender's record; with `offer`, fed by that offer's parts (the offered flow)."""
        record = self._add(SendRecord(request_id, engine_id, components, self._clock(),
                                      receiver_address=receiver_address))
        if offer is not None:
            self.feed(record, offer)
        return record

    def feed(self, record: SendRecord, offer: Offer) -> None:
        """`offer`'s parts feed `record` from now on (taken over from another receiver's unwritten offer)."""
        if record.offer is not None and record.offer is not offer:
            record.offer.record = None
        record.offer, offer.record = offer, record
        record.receiver_address = offer.receiver_address

    def sender_heard(self, record: GrantRecord, sender_id: str, epoch: int | None = None) -> None:
        """An offered grant's sender named itself: in its answer to the offer (with its epoch), or a notice."""
        if record.offered is not None:
            record.offered.sender_id = sender_id
            record.offered.sender_epoch = record.offered.sender_epoch if epoch is None else epoch

    def _publish(self, record: TransferRecord, *, state_changed: bool = True) -> None:
        status = record.snapshot()
        for queue in record.watchers:
            queue.put_nowait(status)
        if state_changed and self._observer is not None:
            self._observer.transfer_changed(record)

    def written(self, record: SendRecord, *, pages: int, runs: int, nbytes: int, truncated: int) -> None:
        """What the claimed flow's write moved, before the receiver confirms it (the notice carries it)."""
        if not record.settled:
            record.pages, record.runs, record.nbytes, record.truncated_pages = pages, runs, nbytes, truncated

    def start(self, record: TransferRecord) -> None:
        if record.state is TransferState.PENDING and not record.settled:
            record.state = TransferState.TRANSFERRING
            record.transferring_at = self._clock()
            self.counts[TransferState.TRANSFERRING.name] += 1
            self._publish(record)

    def progress(self, record: TransferRecord, *, landed: dict[Component, int], runs: int, nbytes: int,
                 last: bool = False, aux: Aux | None = None) -> None:
        """A part of a live request landed (`landed`: its pages per component): its counts join the
        record's, and watchers see them (unless it is the `last`, which the caller ends the record
        with at once). `aux`: the last part's at a grant, kept for the SUCCEEDED status."""
        if record.settled:
            return
        if aux is not None and isinstance(record, GrantRecord):
            record.aux = aux
        record.parts += 1
        for kind, pages in landed.items():
            record.component_pages[kind] = record.component_pages.get(kind, 0) + pages
        record.pages += sum(landed.values())
        record.runs += runs
        record.nbytes += nbytes
        if last:
            return
        if record.state is TransferState.PENDING:
            self.start(record)
        else:
            self._publish(record, state_changed=False)

    def _end(self, record: TransferRecord, state: TransferState) -> None:
        record.state = state
        record.finished = self._clock()
        self.counts[state.name] += 1
        if isinstance(record, GrantRecord):
            _cancel_timer(record)
            record.granted = {}
            if record.offered is not None:
                record.offered.landing = None
        record.done.set()
        self._publish(record)
        _log_end(record)
        self._ended[record.key] = None
        self._trim()

    def succeed(self, record: TransferRecord, *, pages: int | None = None, runs: int | None = None,
                nbytes: int | None = None, truncated: int | None = None) -> bool:
        """End a live record SUCCEEDED, with these counts (None: keep what the parts added up to)."""
        if record.settled:
            return False
        for name, value in (("pages", pages), ("runs", runs), ("nbytes", nbytes), ("truncated_pages", truncated)):
            if value is not None:
                setattr(record, name, value)
        if isinstance(record, GrantRecord) and record.claimed_flow:
            record.parts = 1
        self._end(record, TransferState.SUCCEEDED)
        return True

    def fail(self, record: TransferRecord, code: Code | int, reason: str, *, sender_stopped: bool = False) -> bool:
        """Fail a live record; one that already ended or is ending keeps its outcome (returns False).
        A grant still offered to its sender ends once the fence is done (see the module's docstring),
        unless `sender_stopped`: its sender said it failed, or refused the offer."""
        if record.settled:
            return False
        record.code, record.reason = int(code), reason
        if not isinstance(record, GrantRecord) or record.offered is None:
            self._end(record, TransferState.FAILED)
            return True
        record.offered.sender_failed = record.offered.sender_failed or sender_stopped
        if self._fences is None or record.offered.sender_failed:
            self._end(record, TransferState.FAILED)
            return True
        _cancel_timer(record)
        self._fences.begin(record)
        return True

    def interrupt(self, record: SendRecord, code: Code, reason: str) -> asyncio.Task[None] | None:
        """Cancel a live record's sender task, which then fails it with this cause; None: none runs."""
        task = record.task
        if task is None or task.done() or record.settled:
            return None
        record.code, record.reason = int(code), reason
        task.cancel()
        return task

    async def ended(self, records: list[TransferRecord], timeout: float) -> None:
        """Wait (bounded) until these records have ended: an ending one once its fence is done."""
        waits = [r.ending for r in records
                 if isinstance(r, GrantRecord) and r.ending is not None and not r.ending.done()]
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    async def close(self, timeout: float) -> None:
        """Let the fences under way finish (bounded), then cancel the rest: every record ends."""
        if self._fences is not None:
            await self._fences.close(timeout)

    def _expire(self, record: GrantRecord) -> None:
        record.timer = None
        self.fail(record, Code.DEADLINE_EXCEEDED, f"grant expired: no transfer completed within its expiry of "
                                                  f"{record.expires_at - record.started:.3f}s")

    def _trim(self) -> None:
        now = self._clock()
        while self._ended:
            key = next(iter(self._ended))
            record = self._records.get(key)
            stale = record is None or (record.finished or now) + self._retention_s <= now
            if len(self._ended) <= self._max_ended and not stale:
                break
            del self._ended[key]
            if record is not None and record.state.terminal:
                del self._records[key]

    def hand_out(self, record: GrantRecord, granted: np.ndarray, claimant: str) -> Grant:
        """A claimed grant goes to its claimant (the Receiver checked the claim rules): TRANSFERRING,
        with a fresh claim token; `granted` bounds what can land."""
        record.claim_token, record.claimed_pages, record.claimant = secrets.token_hex(16), int(granted.size), claimant
        self.start(record)
        return Grant(granted, record.claim_token, self.remaining_s(record))

    def watch(self, engine_id: str, request_id: str, *, states_only: bool = False,
              terminal_only: bool = False) -> AsyncGenerator[TransferStatus, None]:
        """The current state, then each change of state or (unless `states_only`) parts, to the end; or the end only."""
        return _statuses(self.get(engine_id, request_id), states_only, terminal_only)


class _Fences:
    """The offered grants failing without their sender, each ending once its fence is done."""

    def __init__(self, fence: Callable[[GrantRecord], Awaitable[str]], end: Callable[[GrantRecord], None]) -> None:
        self._fence = fence  # an offered grant's revocation at its sender: "" once confirmed, else why not
        self._end = end
        self._tasks = OwnedTasks()

    def begin(self, record: GrantRecord) -> None:
        loop = asyncio.get_running_loop()
        record.ending = loop.create_task(self._then_end(record), name=f"fence {record.request_id}")
        self._tasks.add(record.ending)

    async def _then_end(self, record: GrantRecord) -> None:
        try:
            note = await self._fence(record)
            if note:
                record.reason = f"{record.reason} ({note})"
        finally:  # cancelled too (close): the record ends either way
            self._end(record)

    async def close(self, timeout: float) -> None:
        await self._tasks.wait(timeout)
        await self._tasks.cancel(1.0)  # a cancelled fence ends its record at once


def _cancel_timer(record: GrantRecord) -> None:
    if record.timer is not None:
        record.timer.cancel()
        record.timer = None


async def _statuses(record: TransferRecord, states_only: bool,
                    terminal_only: bool) -> AsyncGenerator[TransferStatus, None]:
    queue = Watcher()
    record.watchers.add(queue)
    try:
        status = record.snapshot()
        if status.state.terminal or not terminal_only:
            yield status
        while not status.state.terminal:
            change = await queue.get()
            if change.state is not status.state or (change.parts != status.parts and not states_only):
                status = change
                if status.state.terminal or not terminal_only:
                    yield status
    finally:
        record.watchers.discard(queue)


def _log_end(record: TransferRecord) -> None:
    s = record.snapshot()
    log.info(
        "transfer %s", s.state.name.lower(),
        extra={"request_id": s.request_id, "engine_id": s.engine_id, "role": s.role.name.lower(),
               "peer": record.peer, "components": [c.name for c in s.components], "pages": s.pages,
               "runs": s.runs, "bytes": s.bytes, "truncated_pages": s.truncated_pages,
               "duration_us": s.duration_us, "outcome": s.state.name,
               "code": code_name(s.code) if s.code else "", "reason": s.reason},
    )
