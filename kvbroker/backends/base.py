"""The interface every transfer engine implements, and nothing more.

The Broker calls, in order: `start`; `register`/`deregister` per engine; `metadata` for each
handshake it answers; `connect` with a peer's metadata after each handshake it makes; `write`
per request; `close` at shutdown. Blocking library calls run off the event loop.
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
        """Make a peer known from its metadata; returns the peer handle `write` takes. Idempotent."""

    @abc.abstractmethod
    async def write(self, peer: object, descriptors: Descriptors, timeout: float) -> None:
        """Write every source row to its destination row on the peer; raise TransferFailed or TimeoutError."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the engine. No call may follow."""
