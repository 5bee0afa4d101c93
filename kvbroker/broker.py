"""The Broker: the domain façade the servicers call. One per broker process, built by server.py.

It owns the registry, the transfer table, the sessions and the backend, and hands each call on:
- lifecycle (server.py): `start`, `drain`, `close`;
- engines (BrokerService): `register_engine`, `unregister_engine`; sessions (sessions.py):
  `open_session`, `end_session`, `sessions`;
- receiver side: `expect_transfer` (BrokerService); `handshake_view`, `claim`, `complete`
  (PeerService, peer_service.py);
- sender side: `transfer` (BrokerService), run by the Sender (sender.py), which reaches peers
  through the PeerLink the Broker is built with;
- both sides: `watch`, `cancel`.
New sessions, engines, grants, handshakes, claims and transfers are refused UNAVAILABLE once the
drain has begun.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.errors import BrokerError, Code, invalid, not_found
from kvbroker.memory import check_segments
from kvbroker.model import Component, EngineSpec, TransferRole, TransferState
from kvbroker.peer_link import PeerLink
from kvbroker.registry import Engine, Registry
from kvbroker.sender import Sender, TransferCommand
from kvbroker.sessions import Session, Sessions
from kvbroker.transfers import Grant, TransferRecord, TransferStatus, TransferTable
from kvbroker.validation import check_components, check_identifier, check_page_ids, registered_pages

if TYPE_CHECKING:
    from kvbroker.metrics import Metrics

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class Limits:
    max_pages_per_request: int
    default_grant_expiry_s: float
    max_grant_expiry_s: float
    transfer_timeout_s: float
    peer_rpc_timeout_s: float


class Broker:
    def __init__(self, broker_id: str, epoch: int, backend: Backend, limits: Limits, peers: PeerLink,
                 metrics: Metrics | None = None) -> None:
        self.broker_id = broker_id
        self.epoch = epoch  # this process's: new_epoch() in server.py, also handed to the peer clients
        self.backend = backend
        self.limits = limits
        self.registry = Registry(limits.max_pages_per_request, observer=metrics)
        self.table = TransferTable(observer=metrics)  # it also logs each request's end
        self.sender = Sender(self.registry, self.table, backend, peers, limits)
        self.accepting = True
        self.stopping = asyncio.Event()  # set when the drain is over: sessions' streams end
        self._register_lock = asyncio.Lock()
        self._sessions = Sessions(self.registry, self.unregister_engine)

    async def start(self) -> None:
        await self.backend.start()

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise BrokerError(Code.UNAVAILABLE, "broker is shutting down and accepts no new requests")

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let in-flight ones finish within `grace_s`, then fail the rest."""
        self.accepting = False
        busy = [r for r in self.table.live() if r.task is not None or r.state is TransferState.TRANSFERRING]
        if busy:
            log.info("draining %d in-flight requests (grace %.1fs)", len(busy), grace_s)
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in busy], timeout=grace_s)
        for record in self.table.live():
            await self._abort(record, Code.UNAVAILABLE, "broker shut down before the request completed")
        self.stopping.set()

    async def close(self) -> None:
        self.accepting = False
        self.stopping.set()
        await self._sessions.close(timeout=self.limits.peer_rpc_timeout_s * 2)
        for engine in self.registry:
            self.registry.remove(engine.engine_id)
            try:
                await self._release(engine)
            except BrokerError as exc:  # the other engines are still released
                log.warning("engine %s: %s", engine.engine_id, exc.message)
        await self.backend.close()

    async def register_engine(self, spec: EngineSpec, session_id: str = "") -> Engine:
        """Map and register an engine; with `session_id`, it lives only as long as that session."""
        self._check_accepting()
        self._sessions.get(session_id)  # NOT_FOUND before any work
        async with self._register_lock:  # check() compares with the engines added before it
            self.registry.check(spec)
            engine = await _in_thread(self.registry.materialise, spec, undo=lambda e: e.release())
            try:
                try:
                    engine.backend_handle = await self.backend.register(engine.regions)
                except TransferFailed as exc:
                    raise self._engine_failed(exc) from exc
                session = self._sessions.get(session_id)  # it may have ended while the memory was mapped
                engine.session_id = session_id
                self.registry.add(engine)
                if session is not None:
                    session.engine_ids.add(spec.engine_id)
            except BaseException:
                await asyncio.shield(self._release(engine))
                raise
        log.info("engine registered", extra={"engine_id": spec.engine_id, "bytes": engine.registered_bytes,
                                             "session_id": session_id})
        return engine

    async def unregister_engine(self, engine_id: str, wait_s: float) -> int:
        engine = self.registry.get(engine_id)
        live = self.table.live(engine_id)
        writing = [r for r in live if r.state is TransferState.TRANSFERRING]
        if writing:  # never release memory a transfer engine is reading or writing
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in writing], timeout=wait_s)
        failed = 0
        for record in self.table.live(engine_id):
            failed += await self._abort(record, Code.ABORTED, f"engine {engine_id!r} was unregistered")
        if engine_id in self.registry:
            self.registry.remove(engine_id)
            if (session := self._sessions.find(engine.session_id)) is not None:
                session.engine_ids.discard(engine_id)
            await self._release(engine)
        return failed

    async def _release(self, engine: Engine) -> None:
        if engine.backend_handle is not None:
            handle, engine.backend_handle = engine.backend_handle, None
            try:
                await self.backend.deregister(handle)
            except TransferFailed as exc:  # the memory stays mapped: the engine may still reach it
                raise self._engine_failed(exc) from exc
        await asyncio.to_thread(engine.release)  # munmap, cuIpcCloseMemHandle, cuMemFree

    def _engine_failed(self, exc: TransferFailed) -> BrokerError:
        """A transfer engine's failure, at any call, as the caller sees it: ABORTED, in the engine's words."""
        return BrokerError(Code.ABORTED, f"transfer engine {self.backend.name}: {exc}")

    def open_session(self, holder: str) -> Session:
        """A session to register engines under; `end_session` releases them."""
        self._check_accepting()
        return self._sessions.open(holder)

    def end_session(self, session_id: str, wait_s: float) -> None:
        """The session's stream ended: its engines are unregistered in a task of their own."""
        self._sessions.end(session_id, wait_s)

    def sessions(self) -> list[Session]:
        return list(self._sessions)

    async def expect_transfer(self, engine_id: str, request_id: str, components: Sequence[Component],
                              dst_page_ids: np.ndarray, expiry_ms: int) -> TransferStatus:
        self._check_accepting()
        check_identifier(request_id, "request_id")
        engine = self.registry.get(engine_id)
        check_segments(engine.held, engine_id)
        kinds = check_components(components, "components")
        num_pages = registered_pages(engine.layout, kinds)
        check_page_ids(dst_page_ids, "dst_page_ids", num_pages, self.limits.max_pages_per_request, unique=True)
        expiry_s = expiry_ms / 1000 if expiry_ms else self.limits.default_grant_expiry_s
        if expiry_s > self.limits.max_grant_expiry_s:
            raise invalid(f"expiry_ms: {expiry_ms} exceeds the limit of {self.limits.max_grant_expiry_s * 1000:.0f}")
        record = self.table.add_grant(engine_id, request_id, kinds, dst_page_ids, expiry_s)
        return record.snapshot()

    def handshake_view(self, engine_id: str) -> Engine:
        self._check_accepting()
        return self.registry.get(engine_id)

    def check_claimable(self, engine_id: str, request_id: str) -> None:
        """NOT_FOUND, as `claim` answers it, for an engine or a request this broker does not have:
        the peer servicer asks before it converts a claim's page ids."""
        self.registry.get(engine_id)
        try:
            self.table.get(engine_id, request_id)
        except BrokerError:
            raise not_found(f"request_id: no grant for request {request_id!r} on engine {engine_id!r}") from None

    def claim(self, engine_id: str, request_id: str, components: Sequence[Component],
              dst_page_ids: np.ndarray, claimant: str) -> tuple[Grant, int]:
        self._check_accepting()
        engine = self.registry.get(engine_id)
        check_segments(engine.held, engine_id)
        grant = self.table.claim(engine_id, request_id, tuple(components), dst_page_ids, claimant)
        return grant, engine.generation

    def complete(self, engine_id: str, request_id: str, claim_token: str, claimant: str, *, succeeded: bool,
                 code: int, reason: str, pages: int, runs: int, nbytes: int, truncated: int) -> TransferState:
        record = self.table.get(engine_id, request_id)
        if record.role is not TransferRole.RECEIVER:
            raise invalid(f"request_id: request {request_id!r} on engine {engine_id!r} is not a grant")
        if record.state.terminal:
            return record.state
        claimed = bool(claim_token) and claim_token == record.claim_token  # an empty token proves no claim
        if not claimed and (succeeded or record.state is not TransferState.PENDING):
            raise BrokerError(Code.PERMISSION_DENIED, f"claim_token: does not match the claim of {request_id!r}")
        if succeeded:
            if (engine := self.registry.find(engine_id)) is not None:
                try:  # the write may have crossed a segment shrunk meanwhile: its bytes are not there
                    check_segments(engine.held, engine_id)
                except BrokerError as exc:
                    self.table.fail(record, exc.code, exc.message)
                    raise
            self.table.succeed(record, pages=pages, runs=runs, nbytes=nbytes, truncated=truncated)
        else:
            self.table.fail(record, code or Code.ABORTED, f"sender {claimant!r} failed: {reason}")
        return record.state

    async def transfer(self, cmd: TransferCommand, timeout: float | None) -> TransferStatus:
        """Run one Transfer through the sender pipeline (sender.py); its terminal status."""
        self._check_accepting()
        return await self.sender.transfer(cmd, timeout)

    def watch(self, engine_id: str, request_id: str) -> AsyncIterator[TransferStatus]:
        self.table.get(engine_id, request_id)  # NOT_FOUND before the stream starts
        return self.table.watch(engine_id, request_id)

    async def cancel(self, engine_id: str, request_id: str, reason: str) -> TransferStatus:
        record = self.table.get(engine_id, request_id)
        await self._abort(record, Code.CANCELLED, f"cancelled: {reason[:256] or 'by the caller'}")
        return record.snapshot()

    async def _abort(self, record: TransferRecord, code: Code, reason: str) -> int:
        if record.state.terminal:
            return 0
        task = record.task
        if task is not None and not task.done():
            record.code, record.reason = int(code), reason  # the sender fails the record with these
            task.cancel()
            await asyncio.wait([task], timeout=self.limits.peer_rpc_timeout_s * 2)
            return 1
        return int(self.table.fail(record, code, reason))


async def _in_thread(fn: Callable, *args, undo: Callable):
    """`fn(*args)` in a worker thread. If the caller is cancelled meanwhile, the thread still runs to
    its end, and `undo` (also in a thread) releases what it made, so nothing is left mapped."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        def release(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                loop.run_in_executor(None, undo, f.result())
        future.add_done_callback(release)
        raise
