"""Sessions: an inference server's hold on its engines, opened with an OpenSession stream and ended
with it. `Sessions` keeps the open ones (`open`, `get`, `find`, `end`, `close`); when one ends, its
engines are unregistered through the Broker, in a task `Sessions` owns (the stream's handler may be
cancelled and cannot wait for in-flight writes). Used by the Broker only, on the event loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from kvbroker.core.errors import BrokerError, invalid, not_found
from kvbroker.core.tasks import OwnedTasks
from kvbroker.flows.registry import Registry

log = logging.getLogger("kvbroker.transfer")  # the Broker's, whose lines these were

MAX_HOLDER_CHARS = 128


@dataclass
class Session:
    """An inference server's hold on its engines: they are unregistered when its stream ends."""

    session_id: str
    holder: str  # who opened it, as it said, for logs
    opened_at: float  # wall-clock seconds
    engine_ids: set[str] = field(default_factory=set)


class Sessions:
    def __init__(self, registry: Registry, unregister: Callable[[str, float], Awaitable[int]]) -> None:
        self._registry = registry
        self._unregister = unregister  # Broker.unregister_engine(engine_id, wait_s)
        self._open: dict[str, Session] = {}
        self._tasks = OwnedTasks()

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._open.values()))

    def open(self, holder: str) -> Session:
        if len(holder) > MAX_HOLDER_CHARS:
            raise invalid(f"holder: {len(holder)} characters exceed the limit of {MAX_HOLDER_CHARS}")
        session = Session(f"s-{secrets.token_hex(8)}", holder, time.time())
        self._open[session.session_id] = session
        log.info("session opened", extra={"session_id": session.session_id, "holder": holder})
        return session

    def get(self, session_id: str) -> Session | None:
        """The open session `session_id`; None for none (""); NOT_FOUND for one that is not open."""
        if not session_id:
            return None
        session = self._open.get(session_id)
        if session is None:
            raise not_found(f"session_id: no open session {session_id!r} on this broker (it ended, or the "
                            "broker restarted); open a new one")
        return session

    def find(self, session_id: str) -> Session | None:
        return self._open.get(session_id)

    def end(self, session_id: str, wait_s: float) -> None:
        """The session's stream ended: unregister its engines, in a task of ours."""
        session = self._open.pop(session_id, None)
        if session is None:
            return
        self._tasks.spawn(self._release(session, wait_s), f"end session {session_id}")

    async def _release(self, session: Session, wait_s: float) -> None:
        released = 0
        for engine_id in sorted(session.engine_ids):
            engine = self._registry.find(engine_id)
            if engine is None or engine.session_id != session.session_id:
                continue  # unregistered by its server, or registered again under another session
            try:
                await self._unregister(engine_id, wait_s)
                released += 1
            except BrokerError as exc:  # unregistered meanwhile
                log.debug("session %s: engine %s: %s", session.session_id, engine_id, exc)
        log.info("session ended", extra={"session_id": session.session_id, "holder": session.holder,
                                         "engines_released": released})

    async def close(self, timeout: float) -> None:
        """End every session at once (no wait for writes) and wait up to `timeout` for their engines to go."""
        for session_id in list(self._open):
            self.end(session_id, 0.0)
        await self._tasks.wait(timeout)
