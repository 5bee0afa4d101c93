"""Two Brokers in one process, with no gRPC and no transfer engine between them, for tests that drive
the send and receive pipelines whole (the offered and the claimed flow) without processes:

- `MemoryBackend`: a Backend that writes with memmove, refusing (TransferFailed) any destination row
  outside the regions the peer's handshake declared, as a protected engine refuses a write outside
  registered memory;
- `LinkedPeers`: a PeerLink that hands each peer call to the other Broker's method that the peer
  servicer (edge/peer_service.py) would call, with the caller's identity;
- `linked_pair()`: a prefill and a decode Broker so linked; `host_engine()`: an engine on a shared-
  memory pool of the SMALL shape, registered as RegisterEngine would register it.
The integration tests (tests/integration) move the same requests through real brokers and engines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.config import Settings
from kvbroker.core.identity import PeerIdentity
from kvbroker.core.model import Region, TransferState
from kvbroker.core.validation import declared_regions
from kvbroker.edge import convert
from kvbroker.flows.broker import Broker
from kvbroker.flows.limits import Limits
from kvbroker.peers.link import ClaimResult, PeerSession
from kvbroker_client.shm import SharedSegment
from kvbroker_tools import shapes


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self) -> None:
        self._metadata = f"memory:{id(self)}".encode()
        self.rows_written = 0

    async def start(self) -> None: ...
    async def register(self, regions): return tuple(regions)
    async def deregister(self, handle) -> None: ...
    async def metadata(self) -> bytes: return self._metadata
    def is_own(self, metadata: bytes) -> bool: return metadata == self._metadata
    async def connect(self, metadata: bytes, regions=()): return tuple(regions)
    async def disconnect(self, handle) -> None: ...
    def writing(self, peer) -> bool: return False
    async def close(self) -> None: ...

    async def write(self, peer: tuple[Region, ...], descriptors, timeout: float) -> None:
        rows = list(zip(descriptors.src.tolist(), descriptors.dst.tolist()))
        for (_, length, _), (address, dst_length, _) in rows:  # all checked before any byte moves
            if length != dst_length or not any(r.address <= address and address + length <= r.address + r.length
                                               for r in peer):
                raise TransferFailed(f"row of {length} bytes at {address:#x} outside the peer's registered memory")
        for (src, length, _), (dst, _, _) in rows:
            ctypes.memmove(dst, src, length)
        self.rows_written += len(rows)


class LinkedPeers:
    """The PeerLink of one Broker whose peers are Brokers of this process, by peer address."""

    def __init__(self, broker_id: str, backend: Backend) -> None:
        self.me = PeerIdentity(broker_id, False, "inproc")
        self.brokers: dict[str, Broker] = {}
        self.records: dict[str, SimpleNamespace] = {}
        self.calls: list[str] = []  # the peer calls made, in order (what a stream would carry)
        self._sessions: dict[tuple[str, str], PeerSession] = {}  # as PeerClients keeps them, until a refresh
        self._backend = backend
        self.epoch = 0  # this side's Broker's, set by linked_pair

    def _peer(self, address: str, call: str) -> Broker:
        self.calls.append(call)
        return self.brokers[address]

    async def session(self, address, engine_id, *, refresh, timeout, expect=""):
        if not refresh and (address, engine_id) in self._sessions:
            return self._sessions[address, engine_id]
        view = await self._peer(address, "Handshake").handshake(self._backend.name, engine_id)
        handle = await self._backend.connect(view.metadata, declared_regions(view.layout))
        record = self.records.setdefault(address, SimpleNamespace(address=address, broker_id="", epoch=0,
                                                                  handshakes=0))
        record.broker_id, record.epoch, record.handshakes = view.broker_id, view.epoch, record.handshakes + 1
        session = self._sessions[address, engine_id] = PeerSession(address, view.broker_id, view.epoch,
                                                                   view.generation, view.layout, handle)
        return session

    async def claim(self, session, request_id, components, dst_page_ids, timeout):
        other = self._peer(session.address, "ClaimGrant")
        grant, generation = other.claim(self.me, session.engine.engine_id, request_id,
                                        lambda: (tuple(components), np.asarray(dst_page_ids, dtype=np.int64)))
        return ClaimResult(grant, other.epoch, generation)

    async def complete(self, address, engine_id, request_id, claim_token, status, timeout):
        return self._peer(address, "CompleteTransfer").complete(
            self.me, engine_id, request_id, claim_token, succeeded=status.state is not TransferState.FAILED,
            code=status.code, reason=status.reason, pages=status.pages, runs=status.runs)

    async def offer(self, address, offer, timeout):
        other = self._peer(address, "OfferGrant")
        other.receive_offer(self.me, offer.sender_engine_id, sum(len(p) for p in offer.granted.values()),
                            lambda max_pages: offer, self.epoch)
        return other.broker_id, other.epoch

    async def revoke(self, address, engine_id, request_id, token, code, reason, timeout):
        return await self._peer(address, "RevokeOffer").revoke_offer(self.me, engine_id, request_id, token, code,
                                                                     reason, timeout)

    async def notify(self, address, notice):
        return self._peer(address, "NotifyParts").take_notices(self.me, [notice])[0]


@dataclass
class Side:
    broker: Broker
    peers: LinkedPeers
    address: str
    segments: list[SharedSegment] = field(default_factory=list)


@contextlib.asynccontextmanager
async def linked_pair(**settings) -> AsyncIterator[tuple[Side, Side]]:
    """A prefill and a decode Broker, each the other's only peer; their engines' pools unlinked after."""
    sides = []
    for number, name in enumerate(("prefill", "decode"), start=1):
        backend = MemoryBackend()
        peers = LinkedPeers(f"{name}-broker", backend)
        peers.epoch = number
        address = f"unix:/memory/{name}"
        broker = Broker(f"{name}-broker", number, backend, Limits.from_settings(Settings(**settings)), peers,
                        peer_address=address)
        await broker.start()
        sides.append(Side(broker, peers, address))
    prefill, decode = sides
    prefill.peers.brokers[decode.address] = decode.broker
    decode.peers.brokers[prefill.address] = prefill.broker
    try:
        yield prefill, decode
    finally:
        for side in sides:
            await side.broker.close()
            for segment in side.segments:
                segment.close()
                segment.unlink()


@dataclass
class HostEngine:
    engine_id: str
    segment: SharedSegment
    placements: list


async def host_engine(side: Side, role: str, *, fill: str, seed: int = 0) -> HostEngine:
    """An engine of the SMALL shape (MAIN_KV and MINIMAX_INDEX_K) on a pool of its own, registered."""
    placements = shapes.place_buffers(shapes.SMALL)
    segment = SharedSegment.create(shapes.pool_size(shapes.SMALL, placements), f"kvbu-{role}")
    side.segments.append(segment)
    if fill == "random":
        shapes.fill_random(segment.array, np.random.default_rng(seed))
    else:
        segment.array[:] = shapes.CANARY
    engine_id = f"{role}-{os.getpid()}/tp0"
    request = shapes.register_request(engine_id, shapes.SMALL, segment, placements)
    await side.broker.register_engine(convert.engine_spec_in(request))
    return HostEngine(engine_id, segment, placements)
