"""The interface every transfer engine implements, and nothing more.

The broker calls, in order: `start`; `register`/`deregister` per engine; `metadata` for each
handshake it answers; `connect` with a peer's metadata after each handshake it makes; `write`
per request, with a peer handle that `connect` returned; `disconnect` once for each `connect` whose
handshake it has replaced or dropped (the peer restarted, re-registered, became unreachable or
sat idle); `close` at shutdown, which releases whatever is still connected. `writing` tells the
idle policy whether a write to a peer runs.

Peer handles are counted: several handshakes with one peer broker (one per remote engine, each
refresh) may return the same handle, and the engine forgets the peer only when every `connect`
of it has been matched by a `disconnect` and no `write` to it is still running. Blocking library
calls run off the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from kvbroker.planner import Descriptors
from kvbroker.registry import Region


class TransferFailed(Exception):
    """The transfer engine reported a failure; the message carries the engine's word."""


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
    async def connect(self, metadata: bytes) -> object:
        """Make a peer known from its metadata; returns the peer handle `write` takes. Counted: the same
        peer's metadata yields an equal handle each time, and each call is undone by one `disconnect`."""

    @abc.abstractmethod
    async def disconnect(self, peer: object) -> None:
        """Undo one `connect` that returned `peer`; the last one lets the engine forget the peer, once
        no write to it is running. The handle must not be written to through this reference again."""

    @abc.abstractmethod
    async def write(self, peer: object, descriptors: Descriptors, timeout: float) -> None:
        """Write every source row to its destination row on the peer; raise TransferFailed or TimeoutError."""

    @abc.abstractmethod
    def writing(self, peer: object) -> bool:
        """Whether a `write` to `peer` is running. Called on the event loop, it must not block."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the engine. No call may follow."""
