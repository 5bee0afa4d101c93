"""Request lifecycle on one broker: records, states, grant expiry, claims, watchers.

A record is a request as one broker sees it: the receiver's grant or the sender's transfer, keyed
by (engine_id, request_id). `TransferTable` owns every record, every expiry timer and every
watcher queue; the Broker (receiver side) and the Sender (sender side) drive its state changes,
servicers read snapshots and watch:
- lookup: `get`, `live`;
- creation: `add_grant` (ExpectTransfer), `add_send` (Transfer);
- state changes: `start` (TRANSFERRING), `succeed`, `fail`; a grant's expiry fails it by itself;
- the receiver's grant: `claim`, once, by the sender's ClaimGrant;
- `watch`: the current state, then every change.
Every state change passes through `_add`, `start` or `_end`: there the table tells its observer
(metrics), and `_end` writes the one log line of each request's end, whatever ended it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvbroker.errors import BrokerError, Code, code_name, not_found
from kvbroker.model import Component, TransferRole, TransferState

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
    # receiver side
    dst_page_ids: np.ndarray | None = None
    expires_at: float | None = None
    claim_token: str = ""
    # ownership: timers and the sender's task are cancelled when the record ends
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task | None = None
    watchers: set[asyncio.Queue] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> tuple[str, str]:
        return (self.engine_id, self.request_id)

    def snapshot(self) -> TransferStatus:
        end = self.finished if self.finished is not None else time.monotonic()
        return TransferStatus(
            self.request_id, self.engine_id, self.role, self.state, self.components, self.code, self.reason,
            self.pages, self.runs, self.bytes, self.truncated_pages, int((end - self.started) * 1e6),
        )


class TransferObserver(Protocol):
    def transfer_changed(self, record: TransferRecord) -> None:
        """After each state change of `record`: accepted (PENDING), TRANSFERRING, SUCCEEDED or FAILED."""


class TransferTable:
    """Every live and recently ended request of one broker. Used on the event loop only."""

    def __init__(self, retention_s: float = 300.0, max_ended: int = 10000,
                 clock: Callable[[], float] = time.monotonic, observer: TransferObserver | None = None) -> None:
        self._observer = observer
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

    def add_grant(self, engine_id: str, request_id: str, components: tuple[Component, ...],
                  dst_page_ids: np.ndarray, expiry_s: float) -> TransferRecord:
        now = self._clock()
        record = self._add(TransferRecord(request_id, engine_id, TransferRole.RECEIVER, components, now,
                                          dst_page_ids=dst_page_ids, expires_at=now + expiry_s))
        record.timer = asyncio.get_running_loop().call_later(expiry_s, self._expire, record)
        return record

    def add_send(self, engine_id: str, request_id: str, components: tuple[Component, ...],
                 peer: str = "") -> TransferRecord:
        return self._add(TransferRecord(request_id, engine_id, TransferRole.SENDER, components, self._clock(),
                                        peer=peer))

    def _publish(self, record: TransferRecord) -> None:
        status = record.snapshot()
        for queue in record.watchers:
            queue.put_nowait(status)
        if self._observer is not None:
            self._observer.transfer_changed(record)

    def start(self, record: TransferRecord) -> None:
        if record.state is TransferState.PENDING:
            record.state = TransferState.TRANSFERRING
            record.transferring_at = self._clock()
            self.counts[TransferState.TRANSFERRING.name] += 1
            self._publish(record)

    def _end(self, record: TransferRecord, state: TransferState) -> None:
        record.state = state
        record.finished = self._clock()
        self.counts[state.name] += 1
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        record.dst_page_ids = None if state is TransferState.SUCCEEDED else record.dst_page_ids
        record.done.set()
        self._publish(record)
        self._log_end(record)
        self._ended[record.key] = None
        self._trim()

    @staticmethod
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

    def succeed(self, record: TransferRecord, *, pages: int, runs: int, nbytes: int, truncated: int) -> bool:
        if record.state.terminal:
            return False
        record.pages, record.runs, record.bytes, record.truncated_pages = pages, runs, nbytes, truncated
        self._end(record, TransferState.SUCCEEDED)
        return True

    def fail(self, record: TransferRecord, code: Code | int, reason: str) -> bool:
        """Fail a live record; a record that already ended keeps its outcome (returns False)."""
        if record.state.terminal:
            return False
        record.code, record.reason = int(code), reason
        self._end(record, TransferState.FAILED)
        return True

    def _expire(self, record: TransferRecord) -> None:
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

    def claim(self, engine_id: str, request_id: str, components: tuple[Component, ...],
              dst_page_ids: np.ndarray, claimant: str) -> Grant:
        """Hand a grant to one sender, once. Raises without changing the grant when refused."""
        try:
            record = self.get(engine_id, request_id)
        except BrokerError:
            raise not_found(f"request_id: no grant for request {request_id!r} on engine {engine_id!r}") from None
        if record.role is not TransferRole.RECEIVER:
            raise not_found(f"request_id: request {request_id!r} on engine {engine_id!r} is not a grant")
        if record.state is TransferState.FAILED:
            code = Code.DEADLINE_EXCEEDED if record.code == Code.DEADLINE_EXCEEDED else Code.FAILED_PRECONDITION
            raise BrokerError(code, f"grant {request_id!r} has failed: {record.reason}")
        if record.state is not TransferState.PENDING:
            raise BrokerError(Code.PERMISSION_DENIED,
                              f"grant {request_id!r} was already claimed (state {record.state.name})")
        outside = [c.name for c in components if c not in record.components]
        if outside:
            raise BrokerError(Code.PERMISSION_DENIED,
                              f"components: {', '.join(outside)} not in the grant for request {request_id!r}")
        granted = record.dst_page_ids
        if dst_page_ids.size:
            inside = np.isin(dst_page_ids, granted)
            if not inside.all():
                bad = int(np.flatnonzero(~inside)[0])
                raise BrokerError(
                    Code.PERMISSION_DENIED,
                    f"dst_page_ids[{bad}]: page {int(dst_page_ids[bad])} is outside the grant for request "
                    f"{request_id!r}",
                )
            granted = dst_page_ids
        record.claim_token = secrets.token_hex(16)
        record.peer = claimant
        self.start(record)
        return Grant(granted, record.claim_token, max(0.0, record.expires_at - self._clock()))

    async def watch(self, engine_id: str, request_id: str) -> AsyncIterator[TransferStatus]:
        """The current state, then every change, ending after a terminal state."""
        record = self.get(engine_id, request_id)
        queue: asyncio.Queue[TransferStatus] = asyncio.Queue()
        record.watchers.add(queue)
        try:
            status = record.snapshot()
            yield status
            while not status.state.terminal:
                change = await queue.get()
                if change.state is not status.state:
                    status = change
                    yield status
        finally:
            record.watchers.discard(queue)
