"""What a Broker needs of its peers, as a protocol, and what it gets back: `PeerLink` (implemented
by PeerClients, peers/clients.py), `PeerSession` (a handshake's result) and `ClaimResult`; and the
messages of the offered flow as the domain sees them: `GrantOffer` (a receiver offers a grant),
`PartNotice` (a sender says a part landed or failed) and `PartAck` (the receiver's answer); and
`ReplyBounds`, what a peer's answers are held to. Here
so that the sender, the receiver and the peer clients import them without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from google.protobuf.message import Message

from kvbroker.core.model import Component, EngineLayout, TransferState
from kvbroker.core.parts import Landed
from kvbroker.flows.transfers import Grant, TransferStatus


class ReplyBounds(Protocol):
    """The bounds a peer's answer is held to before anything is built from it (edge/admission.py's
    RequestLimits, handed in by server.py: the peer port's message limit and its list bounds)."""

    @property
    def port_bytes(self) -> int: ...

    @property
    def notice_bytes(self) -> int: ...

    def check_lists(self, request: Message) -> Refused | None: ...


class Refused(Protocol):
    @property
    def message(self) -> str: ...


@dataclass(frozen=True)
class PeerSession:
    """A handshake's result: one remote engine as this broker may write to it."""

    address: str
    broker_id: str
    epoch: int
    generation: int
    engine: EngineLayout
    peer_handle: object  # what Backend.connect returned for the peer's metadata


@dataclass(frozen=True)
class ClaimResult:
    grant: Grant
    epoch: int
    generation: int


@dataclass(frozen=True)
class GrantOffer:
    """A grant one broker offers another: where to write (engine_id, pages), until when, with which token."""

    peer_address: str  # the offering broker's peer listener
    engine_id: str  # the receiving engine
    request_id: str
    sender_engine_id: str  # empty: any engine of the called broker
    granted: dict[Component, np.ndarray]
    remaining_s: float
    token: str
    generation: int
    src_offsets: dict[Component, int] = field(default_factory=dict)  # the sender's page on entry 0, where not 0


@dataclass(frozen=True)
class PartNotice:
    """What became of one part of an offered grant, as its sender tells the receiver."""

    engine_id: str  # the receiving engine
    request_id: str
    token: str
    part: int
    parts_total: int  # with the last part: the parts of the request; else 0
    succeeded: bool
    landed: tuple[Landed, ...] = ()
    aux: bytes = b""
    code: int = 0
    reason: str = ""


@dataclass(frozen=True)
class PartAck:
    """The receiver's answer to a notice: the grant's state, or why the notice was refused."""

    state: TransferState | None  # None when the receiver holds no such grant
    code: int = 0  # 0: taken
    reason: str = ""


class PeerView(Protocol):
    """A peer broker this one handshakes with, as GetBrokerInfo shows it (clients.PeerRecord)."""

    @property
    def address(self) -> str: ...
    @property
    def broker_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def handshakes(self) -> int: ...


class PeerLink(Protocol):
    @property
    def records(self) -> Mapping[str, PeerView]:
        """The peer brokers handshaked with and not forgotten (idle ones are), by address."""
        ...

    async def session(self, address: str, engine_id: str, *, refresh: bool, timeout: float,
                      expect: str = "") -> PeerSession:
        """A handshake with `engine_id` at `address`; with `expect`, the broker answering must be that
        identity (under peer TLS: its certificate names it)."""
        ...

    async def claim(self, session: PeerSession, request_id: str, components: Sequence[Component],
                    dst_page_ids: np.ndarray, timeout: float) -> ClaimResult: ...

    async def complete(self, address: str, engine_id: str, request_id: str, claim_token: str,
                       status: TransferStatus, timeout: float) -> TransferState: ...

    async def offer(self, address: str, offer: GrantOffer, timeout: float) -> tuple[str, int]:
        """Offer a grant to the broker at `address`; its broker id and epoch."""
        ...

    async def revoke(self, address: str, engine_id: str, request_id: str, token: str, code: int, reason: str,
                     timeout: float) -> bool:
        """Revoke an offer; whether no write into it runs on the sender any longer (quiesced)."""
        ...

    async def notify(self, address: str, notice: PartNotice) -> PartAck:
        """Tell a receiver about one part (batched with other notices to the same peer)."""
        ...
