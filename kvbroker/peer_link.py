"""What a Broker needs of its peers, as a protocol, and what it gets back: `PeerLink` (implemented
by PeerClients, peer_clients.py), `PeerSession` (a handshake's result) and `ClaimResult`. Here so that
the sender and the peer clients both import them without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvbroker.model import Component, EngineLayout, TransferState
from kvbroker.transfers import Grant, TransferStatus


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


class PeerLink(Protocol):
    async def session(self, address: str, engine_id: str, *, refresh: bool, timeout: float) -> PeerSession: ...

    async def claim(self, session: PeerSession, request_id: str, components: Sequence[Component],
                    dst_page_ids: np.ndarray, timeout: float) -> ClaimResult: ...

    async def complete(self, address: str, engine_id: str, request_id: str, claim_token: str,
                       status: TransferStatus, timeout: float) -> TransferState: ...
