"""The interface every transfer engine implements, and nothing more.

A backend is built from `BackendOptions` (create_backend, from the broker's Settings). The broker
calls, in order: `start`; `register`/`deregister` per engine; `metadata` for each
handshake it answers; `connect` with a peer's metadata after each handshake it makes; `write`
per request, with a peer handle that `connect` returned; `disconnect` once for each `connect` whose
handshake it has replaced or dropped (the peer restarted, re-registered, became unreachable or
sat idle); `close` at shutdown, which releases whatever is still connected. `writing` tells the
idle policy whether a write to a peer runs.

Peer handles are counted: several handshakes with one peer broker (one per remote engine, each
refresh) may return the same handle, and the engine forgets the peer only when every `connect`
of it has been matched by a `disconnect` and no `write` to it is still running; `PeerRefs` keeps
those counts for both backends. Blocking library calls run off the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvbroker.core.model import Descriptors, Region

S = TypeVar("S")


@dataclass(frozen=True)
class BackendOptions:
    """What a backend reads of the broker's settings; create_backend builds it from Settings."""

    agent_name: str  # this broker's name towards its engine (NIXL adds a random suffix)
    transfer_timeout_s: float  # upper bound of one Transfer, seconds (Mooncake's engine timeout follows it)
    advertised_host: str  # the host peers reach this broker by (Mooncake serves its session there)
    mooncake_protocol: str  # tcp, or rdma in clusters
    mooncake_device: str  # RDMA device names (e.g. mlx5_0), empty for tcp
    data_ports: range | None = None  # where the engine's listeners go (data_port_range; ports.py); None: its default
    nixl_progress_poll_ms: int = 1  # NIXL's progress thread: its poll() timeout between UCX events


class TransferFailed(Exception):
    """The transfer engine reported a failure; the message carries the engine's word. Every call of a
    backend raises it for whatever its engine raises or returns as an error, so the broker can report
    each as ABORTED: an engine's failure is never INTERNAL, which is kept for kvbroker's own bugs."""


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Create the engine (agent, session). Called once before anything else."""

    @abc.abstractmethod
    async def register(self, regions: Sequence[Region]) -> object:
        """Register memory with the engine; returns a handle for `deregister`."""

    @abc.abstractmethod
    async def deregister(self, handle: object) -> None:
        """Release a registration made by `register`."""

    @abc.abstractmethod
    async def metadata(self) -> bytes:
        """What a peer needs to write into this broker's registered memory."""

    @abc.abstractmethod
    def is_own(self, metadata: bytes) -> bool:
        """Whether a peer's metadata names this engine itself (a peer replaying ours): a broker never
        writes into its own memory through a peer. Called on the event loop, it must not block."""

    @abc.abstractmethod
    async def connect(self, metadata: bytes, regions: Sequence[Region] = ()) -> object:
        """Make a peer known from its metadata; returns the peer handle `write` takes. Counted: the same
        peer's metadata yields an equal handle each time, and each call is undone by one `disconnect`.
        `regions`: the layer buffers the peer's handshake declares, which every write to it lies in; a
        backend whose metadata names the peer's registered memory refuses (TransferFailed) metadata
        that does not hold them all."""

    @abc.abstractmethod
    async def disconnect(self, peer: object) -> None:
        """Undo one `connect` that returned `peer`; the last one lets the engine forget the peer, once
        no write to it is running. The handle must not be written to through this reference again."""

    @abc.abstractmethod
    async def write(self, peer: object, descriptors: Descriptors, timeout: float) -> None:
        """Write every source row to its destination row on the peer; raise TransferFailed or TimeoutError.
        It returns or raises once the engine is done with the rows: a write past `timeout` is let end
        (bounded by the backend's own engine timeout) before TimeoutError, since the caller then tells
        the receiver, which takes its pages back."""

    @abc.abstractmethod
    def writing(self, peer: object) -> bool:
        """Whether a `write` to `peer` is running. Called on the event loop, it must not block."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the engine. No call may follow."""


@dataclass
class PeerRef(Generic[S]):
    connects: int = 0  # connects not yet matched by a disconnect
    uses: int = 0  # writes (or a backend's parts of them) running towards the peer
    state: S | None = None  # what the backend keeps per peer besides the counts


class PeerRefs(Generic[S]):
    """Per peer: the connects not yet matched by a disconnect and the uses (writes) running. A peer
    may be forgotten when both are zero; the caller asks `drop_if_idle` and releases what the engine
    holds of it. Plain bookkeeping, not thread-safe: each backend calls it only from the thread that
    owns its peers (NIXL: its NIXL thread; Mooncake: the event loop)."""

    def __init__(self, state: Callable[[], S] | None = None) -> None:
        self._state = state
        self._peers: dict[Hashable, PeerRef[S]] = {}

    def __contains__(self, peer: Hashable) -> bool:
        return peer in self._peers

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._peers))

    def __len__(self) -> int:
        return len(self._peers)

    def _add(self, peer: Hashable) -> PeerRef[S]:
        ref = self._peers[peer] = PeerRef(state=self._state() if self._state is not None else None)
        return ref

    def connect(self, peer: Hashable) -> bool:
        """Count one connect; True when the peer was not known before."""
        ref = self._peers.get(peer)
        new = ref is None
        if ref is None:
            ref = self._add(peer)
        ref.connects += 1
        return new

    def disconnect(self, peer: Hashable) -> bool:
        """Undo one connect; False, changing nothing, when the peer has none to undo."""
        ref = self._peers.get(peer)
        if ref is None or ref.connects == 0:
            return False
        ref.connects -= 1
        return True

    def begin(self, peer: Hashable) -> PeerRef[S]:
        """A use of the peer starts (a peer not known yet is added); `end` with the returned ref closes it."""
        ref = self._peers.get(peer)
        if ref is None:
            ref = self._add(peer)
        ref.uses += 1
        return ref

    @staticmethod
    def end(ref: PeerRef[S]) -> None:
        ref.uses -= 1

    def busy(self, peer: Hashable) -> bool:
        """Whether a use of the peer runs."""
        ref = self._peers.get(peer)
        return ref is not None and ref.uses > 0

    def drop_if_idle(self, peer: Hashable) -> bool:
        """Forget a peer that nothing holds and nothing uses; True when it was forgotten now."""
        ref = self._peers.get(peer)
        if ref is None or ref.connects or ref.uses:
            return False
        del self._peers[peer]
        return True

    def clear(self) -> None:
        self._peers.clear()
