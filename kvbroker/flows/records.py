"""A request's record as one broker sees it: a core both roles share, and the side of the role it plays.

- `TransferRecord`, the core: request id, engine, components, state and its cause, the counters
  (pages, runs, bytes, parts), the timestamps, the watchers (each a `Watcher`, bounded); `snapshot`
  is what servicers see (`TransferStatus`).
- `GrantRecord`, the receiver's side: the grant's destination pages, its expiry, offered or
  claimed (`OfferedGrant`, or the claim's claimant, token and pages), the aux handed out with
  SUCCEEDED, and the fence under way (`ending`) of an offered grant failing.
- `SendRecord`, the sender's side: the receiver it writes into, and either the claimed flow's
  task or the offer the offered flow's parts write into (`Offer`, the parts' state: numbering,
  coverage, the writes under way).
Only the TransferTable (transfers.py) changes a record's state; the flows read records, and ask
the table for one of the side they need (`TransferTable.find_as`), not a record's role.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvbroker.core.errors import BrokerError, Code, precondition
from kvbroker.core.model import Component, TransferRole, TransferState
from kvbroker.core.parts import Coverage, Landing

Aux = bytes  # TransferStatus has a field named bytes, which hides the type inside its class


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
    bytes: int = 0  # the proto's name (TransferStatus.bytes)
    truncated_pages: int = 0
    duration_us: int = 0
    parts: int = 0
    aux: Aux = b""  # the receiver's, with SUCCEEDED only


@dataclass(frozen=True)
class Grant:
    """What ClaimGrant hands the sender."""

    dst_page_ids: np.ndarray
    claim_token: str
    remaining_s: float


WATCH_BACKLOG = 16  # statuses one watcher holds unread before changes of one state fold into the latest


class Watcher:
    """One watch's statuses not taken yet: past WATCH_BACKLOG of them, a status of the state the latest
    held one has replaces it (a status carries every count so far), so that a watch nobody reads
    holds a bounded number, and each change of state is still seen."""

    def __init__(self) -> None:
        self._held: deque[TransferStatus] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._held)

    def put_nowait(self, status: TransferStatus) -> None:
        if len(self._held) >= WATCH_BACKLOG and self._held[-1].state is status.state:
            self._held[-1] = status
        else:
            self._held.append(status)
        self._ready.set()

    async def get(self) -> TransferStatus:
        while not self._held:
            self._ready.clear()
            await self._ready.wait()
        return self._held.popleft()


@dataclass(eq=False)
class TransferRecord:
    """The core of a request's record, whatever its role."""

    role: ClassVar[TransferRole]
    request_id: str
    engine_id: str
    components: tuple[Component, ...]
    started: float
    state: TransferState = TransferState.PENDING
    code: int = 0
    reason: str = ""
    pages: int = 0
    runs: int = 0
    nbytes: int = 0
    truncated_pages: int = 0
    parts: int = 0
    component_pages: dict[Component, int] = field(default_factory=dict)  # offered flow: pages per component
    transferring_at: float | None = None
    finished: float | None = None
    watchers: set[Watcher] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> tuple[str, str]:
        return (self.engine_id, self.request_id)

    @property
    def settled(self) -> bool:
        """Its outcome is decided: it ended (a grant: or it is ending, see GrantRecord)."""
        return self.state.terminal

    @property
    def peer(self) -> str:
        """The other broker, as the end's log line names it."""
        return ""

    @property
    def claimed_flow(self) -> bool:
        """The claimed flow's request: a write of it, once begun, is let finish."""
        return False

    @property
    def busy(self) -> bool:
        """Something of it runs: a write under way, or the claimed flow's sender task."""
        return self.state is TransferState.TRANSFERRING

    def aux_out(self) -> Aux:
        return b""

    def snapshot(self) -> TransferStatus:
        end = self.finished if self.finished is not None else time.monotonic()
        return TransferStatus(
            self.request_id, self.engine_id, self.role, self.state, self.components, self.code, self.reason,
            self.pages, self.runs, self.nbytes, self.truncated_pages, int((end - self.started) * 1e6),
            self.parts, self.aux_out() if self.state is TransferState.SUCCEEDED else b"",
        )


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
    src_offsets: dict[Component, int] = field(default_factory=dict)  # the sender's page on entry 0, where not 0


@dataclass(eq=False, kw_only=True)
class GrantRecord(TransferRecord):
    """The receiver's side: a grant of destination pages, offered to its sender or claimed by one."""

    role: ClassVar[TransferRole] = TransferRole.RECEIVER
    granted: dict[Component, np.ndarray]  # destination pages per component; emptied at the end
    expires_at: float
    offered: OfferedGrant | None = None  # the offered flow; None: the claimed flow
    claimant: str = ""  # the claimed flow: the broker identity that claimed it
    claim_token: str = ""
    claimed_pages: int = 0  # pages the claim handed out, the bound of what can land
    aux: Aux = b""  # the last part's, handed out with SUCCEEDED
    timer: asyncio.TimerHandle | None = None  # the expiry
    ending: asyncio.Task[None] | None = None  # an offered grant failing: its fence, then its end

    @property
    def settled(self) -> bool:
        """It ended, or it is ending (an offered grant waiting for its fence)."""
        return self.state.terminal or self.ending is not None

    @property
    def peer(self) -> str:
        return self.claimant

    @property
    def claimed_flow(self) -> bool:
        return self.offered is None

    def aux_out(self) -> Aux:
        return self.aux


@dataclass(eq=False, kw_only=True)
class SendRecord(TransferRecord):
    """The sender's side: the receiver it writes into, with the claimed flow's task or the offer
    the offered flow's parts write into."""

    role: ClassVar[TransferRole] = TransferRole.SENDER
    receiver_address: str = ""
    offer: Offer | None = None  # the offered flow; None: the claimed flow
    task: asyncio.Task[None] | None = None  # the claimed flow's sender, owned until it ends

    @property
    def peer(self) -> str:
        return self.receiver_address

    @property
    def claimed_flow(self) -> bool:
        return self.offer is None

    @property
    def busy(self) -> bool:
        return self.task is not None or self.state is TransferState.TRANSFERRING

    def run(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """The claimed flow's sender task: the record owns it until it ends (the table interrupts it)."""
        task = self.task = asyncio.get_running_loop().create_task(coro, name=name)

        def ended(_: asyncio.Task[None]) -> None:
            if self.task is task:
                self.task = None

        task.add_done_callback(ended)
        return task


@dataclass(eq=False)
class Offer:
    """A grant offered to this broker: where to write, with which token, and the parts sent so far
    (the offered flow's sender state; the OfferBook, offers.py, keeps the live ones)."""

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
    src_offsets: dict[Component, int] = field(default_factory=dict)  # the sender's page on entry 0, where not 0
    quota_key: str = ""  # whose per-peer offer quotas it counts against (PeerIdentity.quota_key); "": receiver_id's
    coverage: Coverage = field(init=False)
    next_part: int = 0
    last_part: int | None = None  # the number of the part marked last, once accepted
    writing: int = 0  # parts accepted whose notice has not been answered
    quiesced: asyncio.Event = field(default_factory=asyncio.Event)  # set while writing == 0: no write runs
    ended: BrokerError | None = None  # why no more part may be sent
    revoked: bool = False  # the receiver revoked it (and so needs no word of its end)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    record: SendRecord | None = None  # the sender's record once an engine holds the offer (TransferTable.feed)

    def __post_init__(self) -> None:
        self.coverage = Coverage({k: len(v) for k, v in self.granted.items()})
        self.quiesced.set()

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
        self.quiesced.clear()
        return part

    def end_part(self) -> None:
        self.writing -= 1
        if not self.writing:
            self.quiesced.set()

    @property
    def done(self) -> bool:
        """Every part up to the last one was sent and answered."""
        return self.last_part is not None and self.writing == 0


def ended_error(record: TransferRecord, noun: str) -> BrokerError:
    """Why a request that ended takes no more (a claim, a part); `noun` names it ("grant",
    "request"). A failed one answers DEADLINE_EXCEEDED if it expired, else FAILED_PRECONDITION."""
    what = f"{noun} {record.request_id!r}"
    if record.state is TransferState.SUCCEEDED:
        return precondition(f"{what} completed already; no part may follow")
    if record.code == Code.DEADLINE_EXCEEDED:
        return BrokerError(Code.DEADLINE_EXCEEDED, f"{what} has failed: {record.reason}")
    return precondition(f"{what} has failed: {record.reason}")
