"""Request lifecycle on one broker: records, states, grant expiry, claims, watchers.

A record is a request as one broker sees it: the receiver's grant or the sender's transfer, keyed
by (engine_id, request_id). `TransferTable` owns every record, every expiry timer and every
watcher queue; the Broker (receiver side) and the Sender (sender side) drive its state changes,
servicers read snapshots and watch:
- lookup: `get`, `live`;
- creation: `add_grant` (ExpectTransfer), `add_send` (Transfer, or an offer naming its engine);
- state changes: `start` (TRANSFERRING), `progress` (a part landed), `succeed`, `fail`; a grant's
  expiry fails it by itself;
- the receiver's grant: `claim`, once, by the sender's ClaimGrant (the claimed flow); an offered
  grant (`OfferedGrant`) is filled by parts instead, which the Broker lands;
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
import builtins
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvbroker.core.errors import BrokerError, Code, code_name, not_found, precondition
from kvbroker.core.model import Component, TransferRole, TransferState
from kvbroker.core.parts import Landing
from kvbroker.core.tasks import OwnedTasks

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class TransferStatus:
    request_id: str
    engine_id: str
    role: TransferRole
    state: TransferState
    components: tuple[Component, ...]
    code: int = 0
    reason: str = ""
    pages: int = 0
    runs: int = 0
    bytes: int = 0
    truncated_pages: int = 0
    duration_us: int = 0
    parts: int = 0
    aux: builtins.bytes = b""  # the receiver's, with SUCCEEDED only (builtins: a field is named bytes)


@dataclass(eq=False)
class OfferedGrant:
    """A receiver's grant that it offered to one sending broker (the decode-initiated flow)."""

    sender_address: str
    sender_engine_id: str  # empty: any engine of that broker
    token: str  # the offer's secret; every notice about the grant carries it
    landing: Landing | None  # the parts landed so far; dropped when the grant ends
    sender_id: str = ""  # the sending broker's identity: from its answer to the offer, or its first notice
    sender_epoch: int = 0
    sender_failed: bool = False  # the sender told us it failed: it needs no revocation
    offered: asyncio.Event = field(default_factory=asyncio.Event)  # set once the offer call has returned


@dataclass(frozen=True)
class Grant:
    """What ClaimGrant hands the sender."""

    dst_page_ids: np.ndarray
    claim_token: str
    remaining_s: float


@dataclass(eq=False)
class TransferRecord:
    request_id: str
    engine_id: str
    role: TransferRole
    components: tuple[Component, ...]
    started: float
    state: TransferState = TransferState.PENDING
    code: int = 0
    reason: str = ""
    pages: int = 0
    runs: int = 0
    bytes: int = 0
    truncated_pages: int = 0
    transferring_at: float | None = None
    finished: float | None = None
    peer: str = ""  # the other broker: the address a sender dials, the broker id that claimed a grant
    parts: int = 0
    component_pages: dict[Component, int] = field(default_factory=dict)  # offered flow: pages per component
    # receiver side
    granted: dict[Component, np.ndarray] | None = None  # destination pages per component, until the end
    expires_at: float | None = None
    claim_token: str = ""
    claimed_pages: int = 0  # the claimed flow: pages the claim handed out, the bound of what can land
    offered: OfferedGrant | None = None
    aux: builtins.bytes = b""
    # sender side, the offered flow: the offer it writes into (kvbroker.flows.offers.Offer)
    offer: object = None
    # ownership: timers and the sender's task are cancelled when the record ends
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task | None = None
    ending: asyncio.Task | None = None  # an offered grant failing: its fence, then its end (TransferTable.fail)
    watchers: set[asyncio.Queue] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> tuple[str, str]:
        return (self.engine_id, self.request_id)

    @property
    def settled(self) -> bool:
        """Its outcome is decided: it ended, or it is ending (an offered grant waiting for its fence)."""
        return self.state.terminal or self.ending is not None

    def run(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """The sender's task of this record (the claimed flow): the record owns it until it ends."""
        task = self.task = asyncio.get_running_loop().create_task(coro, name=name)

        def ended(_: asyncio.Task) -> None:
            if self.task is task:
                self.task = None

        task.add_done_callback(ended)
        return task

    def interrupt(self, code: Code, reason: str) -> asyncio.Task | None:
        """Cancel this live record's task, which then fails the record (through the table) with
        this cause; the task, or None when none runs."""
        task = self.task
        if task is None or task.done() or self.settled:
            return None
        self.code, self.reason = int(code), reason
        task.cancel()
        return task

    def snapshot(self) -> TransferStatus:
        end = self.finished if self.finished is not None else time.monotonic()
        aux = self.aux if self.state is TransferState.SUCCEEDED else b""
        return TransferStatus(
            self.request_id, self.engine_id, self.role, self.state, self.components, self.code, self.reason,
            self.pages, self.runs, self.bytes, self.truncated_pages, int((end - self.started) * 1e6),
            self.parts, aux,
        )


def ended_error(record: TransferRecord, noun: str) -> BrokerError:
    """Why a request that ended takes no more (a claim, a part); `noun` names it ("grant",
    "request"). A failed one answers DEADLINE_EXCEEDED if it expired, else FAILED_PRECONDITION."""
    what = f"{noun} {record.request_id!r}"
    if record.state is TransferState.SUCCEEDED:
        return precondition(f"{what} completed already; no part may follow")
    if record.code == Code.DEADLINE_EXCEEDED:
        return BrokerError(Code.DEADLINE_EXCEEDED, f"{what} has failed: {record.reason}")
    return precondition(f"{what} has failed: {record.reason}")


class TransferObserver(Protocol):
    def transfer_changed(self, record: TransferRecord) -> None:
        """After each state change of `record`: accepted (PENDING), TRANSFERRING, SUCCEEDED or FAILED."""


class TransferTable:
    """Every live and recently ended request of one broker. Used on the event loop only."""

    def __init__(self, retention_s: float = 300.0, max_ended: int = 10000,
                 clock: Callable[[], float] = time.monotonic, observer: TransferObserver | None = None,
                 fence: Callable[[TransferRecord], Awaitable[str]] | None = None) -> None:
        self._observer = observer
        self._fence = fence  # an offered grant's revocation at its sender: "" once confirmed, else why not
        self._ending = OwnedTasks()
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

    def with_request_id(self, request_id: str) -> list[TransferRecord]:
        """Every record, live or recently ended, of `request_id` on any engine of this broker."""
        return [r for r in self._records.values() if r.request_id == request_id]

    def live(self, engine_id: str | None = None) -> list[TransferRecord]:
        return [r for r in self._records.values()
                if not r.state.terminal and (engine_id is None or r.engine_id == engine_id)]

    def _add(self, record: TransferRecord) -> TransferRecord:
        old = self._records.get(record.key)
        if old is not None and not old.state.terminal:
            raise BrokerError(
                Code.ALREADY_EXISTS,
                f"request_id: request {record.request_id!r} is already in flight on engine {record.engine_id!r}",
            )
        if old is not None:
            self._ended.pop(old.key, None)
        self._records[record.key] = record
        self.counts[TransferState.PENDING.name] += 1
        if self._observer is not None:
            self._observer.transfer_changed(record)
        return record

    def add_grant(self, engine_id: str, request_id: str, granted: dict[Component, np.ndarray], expiry_s: float,
                  offered: OfferedGrant | None = None) -> TransferRecord:
        """A grant of `granted` (destination pages per component; the claimed flow shares one list
        among its components), failed by itself at `expiry_s`."""
        now = self._clock()
        record = self._add(TransferRecord(request_id, engine_id, TransferRole.RECEIVER, tuple(granted), now,
                                          granted=granted, expires_at=now + expiry_s, offered=offered))
        record.timer = asyncio.get_running_loop().call_later(expiry_s, self._expire, record)
        return record

    def remaining_s(self, record: TransferRecord) -> float:  # what is left of a grant's lifetime, seconds
        return max(0.0, record.expires_at - self._clock()) if record.expires_at is not None else 0.0

    def add_send(self, engine_id: str, request_id: str, components: tuple[Component, ...],
                 peer: str = "") -> TransferRecord:
        return self._add(TransferRecord(request_id, engine_id, TransferRole.SENDER, components, self._clock(),
                                        peer=peer))

    def _publish(self, record: TransferRecord, *, state_changed: bool = True) -> None:
        status = record.snapshot()
        for queue in record.watchers:
            queue.put_nowait(status)
        if state_changed and self._observer is not None:
            self._observer.transfer_changed(record)

    def written(self, record: TransferRecord, *, pages: int, runs: int, nbytes: int, truncated: int) -> None:
        """What the claimed flow's write moved, before the receiver confirms it (its notice carries them)."""
        if not record.settled:
            record.pages, record.runs, record.bytes, record.truncated_pages = pages, runs, nbytes, truncated

    def start(self, record: TransferRecord) -> None:
        if record.state is TransferState.PENDING and record.ending is None:
            record.state = TransferState.TRANSFERRING
            record.transferring_at = self._clock()
            self.counts[TransferState.TRANSFERRING.name] += 1
            self._publish(record)

    def progress(self, record: TransferRecord, *, landed: dict[Component, int], runs: int, nbytes: int,
                 last: bool = False, aux: builtins.bytes | None = None) -> None:
        """A part of a live request landed (`landed`: its pages per component): its counts join the
        record's, and watchers see them (unless it is the `last`, which the caller ends the record
        with at once). `aux`: the last part's, kept for the SUCCEEDED status."""
        if record.settled:
            return
        if aux is not None:
            record.aux = aux
        record.parts += 1
        for kind, pages in landed.items():
            record.component_pages[kind] = record.component_pages.get(kind, 0) + pages
        record.pages += sum(landed.values())
        record.runs += runs
        record.bytes += nbytes
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
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        record.granted = None
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
        for name, value in (("pages", pages), ("runs", runs), ("bytes", nbytes), ("truncated_pages", truncated)):
            if value is not None:
                setattr(record, name, value)
        if record.role is TransferRole.RECEIVER and record.offered is None:
            record.parts = 1
        self._end(record, TransferState.SUCCEEDED)
        return True

    def fail(self, record: TransferRecord, code: Code | int, reason: str) -> bool:
        """Fail a live record; one that already ended or is ending keeps its outcome (returns False).
        A grant still offered to its sender ends once the fence is done (see the module's docstring)."""
        if record.settled:
            return False
        record.code, record.reason = int(code), reason
        offered = record.offered
        if self._fence is None or offered is None or offered.sender_failed:
            self._end(record, TransferState.FAILED)
            return True
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        record.ending = asyncio.get_running_loop().create_task(self._fence_then_end(record),
                                                               name=f"fence {record.request_id}")
        self._ending.add(record.ending)
        return True

    async def _fence_then_end(self, record: TransferRecord) -> None:
        assert self._fence is not None  # fail() starts this only with a fence
        try:
            note = await self._fence(record)
            if note:
                record.reason = f"{record.reason} ({note})"
        finally:  # cancelled too (close): the record ends either way
            self._end(record, TransferState.FAILED)

    async def ended(self, records: list[TransferRecord], timeout: float) -> None:
        """Wait (bounded) until these records have ended: an ending one once its fence is done."""
        waits = [r.ending for r in records if r.ending is not None and not r.ending.done()]
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    async def close(self, timeout: float) -> None:
        """Let the fences under way finish (bounded), then cancel the rest: every record ends."""
        await self._ending.wait(timeout)
        await self._ending.cancel(1.0)  # a cancelled fence ends its record at once

    def _expire(self, record: TransferRecord) -> None:
        assert record.expires_at is not None  # a grant's timer
        record.timer = None
        self.fail(record, Code.DEADLINE_EXCEEDED,
                  f"grant expired: no transfer completed within its expiry of "
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

    def hand_out(self, record: TransferRecord, granted: np.ndarray, claimant: str) -> Grant:
        """A claimed grant goes to its claimant (the Receiver checked the claim): TRANSFERRING, with
        a fresh claim token; `granted` bounds what can land."""
        record.claim_token = secrets.token_hex(16)
        record.claimed_pages = int(granted.size)
        record.peer = claimant
        self.start(record)
        assert record.expires_at is not None  # a grant's
        return Grant(granted, record.claim_token, max(0.0, record.expires_at - self._clock()))

    async def watch(self, engine_id: str, request_id: str) -> AsyncIterator[TransferStatus]:
        """The current state, then every change of state or of the parts landed, ending after a
        terminal state."""
        record = self.get(engine_id, request_id)
        queue: asyncio.Queue[TransferStatus] = asyncio.Queue()
        record.watchers.add(queue)
        try:
            status = record.snapshot()
            yield status
            while not status.state.terminal:
                change = await queue.get()
                if change.state is not status.state or change.parts != status.parts:
                    status = change
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
