"""The Broker: the domain façade the servicers call. One per broker process, built by server.py.

Local API (BrokerService): open_session/end_session, register_engine, unregister_engine,
expect_transfer, transfer, watch, cancel. Peer API (PeerService): handshake, claim, complete.
Lifecycle: start, drain, close.
It owns the registry, the transfer table and the backend; it reaches peers through a PeerLink.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvbroker import topology
from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.errors import BrokerError, Code, invalid, not_found
from kvbroker.model import ComponentKind, EngineSpec, State, TransferRole
from kvbroker.peer_link import PeerLink, PeerSession
from kvbroker.planner import build_descriptors, plan_runs
from kvbroker.registry import Engine, Registry
from kvbroker.transfers import Grant, TransferRecord, TransferStatus, TransferTable
from kvbroker.validation import check_components, check_identifier, check_page_ids, registered_pages

if TYPE_CHECKING:
    from kvbroker.metrics import Metrics

log = logging.getLogger("kvbroker.transfer")


@dataclass(frozen=True)
class TransferCommand:
    request_id: str
    engine_id: str
    peer_address: str
    remote_engine_id: str
    components: tuple[ComponentKind, ...]
    src_page_ids: np.ndarray
    dst_page_ids: np.ndarray  # empty: the grant's


@dataclass
class Session:
    """An inference server's hold on its engines: they are unregistered when its stream ends."""

    session_id: str
    holder: str  # who opened it, as it said, for logs
    opened_at: float  # wall-clock seconds
    engine_ids: set[str] = field(default_factory=set)


MAX_HOLDER_CHARS = 128


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
        self.peers = peers
        self.registry = Registry(limits.max_pages_per_request, observer=metrics)
        self.table = TransferTable(observer=metrics)  # it also logs each request's end
        self.accepting = True
        self.stopping = asyncio.Event()  # set when the drain is over: sessions' streams end
        self._register_lock = asyncio.Lock()
        self._sessions: dict[str, Session] = {}
        self._session_tasks: set[asyncio.Task] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.backend.start()

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise BrokerError(Code.UNAVAILABLE, "broker is shutting down and accepts no new requests")

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let in-flight ones finish within `grace_s`, then fail the rest."""
        self.accepting = False
        busy = [r for r in self.table.live() if r.task is not None or r.state is State.TRANSFERRING]
        if busy:
            log.info("draining %d in-flight requests (grace %.1fs)", len(busy), grace_s)
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in busy], timeout=grace_s)
        for record in self.table.live():
            await self._abort(record, Code.UNAVAILABLE, "broker shut down before the request completed")
        self.stopping.set()

    async def close(self) -> None:
        self.accepting = False
        self.stopping.set()
        for session_id in list(self._sessions):
            self.end_session(session_id, 0.0)
        if self._session_tasks:
            await asyncio.wait(self._session_tasks, timeout=self.limits.peer_rpc_timeout_s * 2)
        for engine in self.registry:
            self.registry.remove(engine.engine_id)
            await self._release(engine)
        await self.backend.close()

    # -- engines --------------------------------------------------------------------------------
    async def register_engine(self, spec: EngineSpec, session_id: str = "") -> Engine:
        """Map and register an engine; with `session_id`, it lives only as long as that session."""
        self._check_accepting()
        self._session(session_id)  # NOT_FOUND before any work
        async with self._register_lock:  # check() compares with the engines added before it
            self.registry.check(spec)
            engine = await _in_thread(self.registry.materialise, spec, undo=lambda e: e.release())
            try:
                engine.backend_handle = await self.backend.register(engine.regions)
                session = self._session(session_id)  # it may have ended while the memory was mapped
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
        writing = [r for r in live if r.state is State.TRANSFERRING]
        if writing:  # never release memory a transfer engine is reading or writing
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in writing], timeout=wait_s)
        failed = 0
        for record in self.table.live(engine_id):
            failed += await self._abort(record, Code.ABORTED, f"engine {engine_id!r} was unregistered")
        if engine_id in self.registry:
            self.registry.remove(engine_id)
            if (session := self._sessions.get(engine.session_id)) is not None:
                session.engine_ids.discard(engine_id)
            await self._release(engine)
        return failed

    async def _release(self, engine: Engine) -> None:
        if engine.backend_handle is not None:
            handle, engine.backend_handle = engine.backend_handle, None
            await self.backend.deregister(handle)
        await asyncio.to_thread(engine.release)  # munmap, cuIpcCloseMemHandle, cuMemFree

    # -- sessions -------------------------------------------------------------------------------
    def open_session(self, holder: str) -> Session:
        """A session to register engines under; `end_session` releases them."""
        self._check_accepting()
        if len(holder) > MAX_HOLDER_CHARS:
            raise invalid(f"holder: {len(holder)} characters exceed the limit of {MAX_HOLDER_CHARS}")
        session = Session(f"s-{secrets.token_hex(8)}", holder, time.time())
        self._sessions[session.session_id] = session
        log.info("session opened", extra={"session_id": session.session_id, "holder": holder})
        return session

    def _session(self, session_id: str) -> Session | None:
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            raise not_found(f"session_id: no open session {session_id!r} on this broker (it ended, or the "
                            "broker restarted); open a new one")
        return session

    def end_session(self, session_id: str, wait_s: float) -> None:
        """The session's stream ended: unregister its engines, in a task the broker owns (the stream's
        handler may be cancelled and cannot wait for in-flight writes)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        task = asyncio.create_task(self._release_session(session, wait_s), name=f"end session {session_id}")
        self._session_tasks.add(task)
        task.add_done_callback(self._session_tasks.discard)

    async def _release_session(self, session: Session, wait_s: float) -> None:
        released = 0
        for engine_id in sorted(session.engine_ids):
            engine = self.registry.find(engine_id)
            if engine is None or engine.session_id != session.session_id:
                continue  # unregistered by its server, or registered again under another session
            try:
                await self.unregister_engine(engine_id, wait_s)
                released += 1
            except BrokerError as exc:  # unregistered meanwhile
                log.debug("session %s: engine %s: %s", session.session_id, engine_id, exc)
        log.info("session ended", extra={"session_id": session.session_id, "holder": session.holder,
                                         "engines_released": released})

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    # -- receiver side --------------------------------------------------------------------------
    async def expect_transfer(self, engine_id: str, request_id: str, components: Sequence[ComponentKind],
                              dst_page_ids: np.ndarray, expiry_ms: int) -> TransferStatus:
        self._check_accepting()
        check_identifier(request_id, "request_id")
        engine = self.registry.get(engine_id)
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

    def claim(self, engine_id: str, request_id: str, components: Sequence[ComponentKind],
              dst_page_ids: np.ndarray, claimant: str) -> tuple[Grant, int]:
        self._check_accepting()
        engine = self.registry.get(engine_id)
        grant = self.table.claim(engine_id, request_id, tuple(components), dst_page_ids, claimant)
        return grant, engine.generation

    def complete(self, engine_id: str, request_id: str, claim_token: str, claimant: str, *, succeeded: bool,
                 code: int, reason: str, pages: int, runs: int, nbytes: int, truncated: int) -> State:
        record = self.table.get(engine_id, request_id)
        if record.role is not TransferRole.RECEIVER:
            raise invalid(f"request_id: request {request_id!r} on engine {engine_id!r} is not a grant")
        if record.state.terminal:
            return record.state
        claimed = bool(claim_token) and claim_token == record.claim_token  # an empty token proves no claim
        if not claimed and (succeeded or record.state is not State.PENDING):
            raise BrokerError(Code.PERMISSION_DENIED, f"claim_token: does not match the claim of {request_id!r}")
        if succeeded:
            self.table.succeed(record, pages=pages, runs=runs, nbytes=nbytes, truncated=truncated)
        else:
            self.table.fail(record, code or Code.ABORTED, f"sender {claimant!r} failed: {reason}")
        return record.state

    # -- sender side ----------------------------------------------------------------------------
    async def transfer(self, cmd: TransferCommand, timeout: float | None) -> TransferStatus:
        """Validate locally, then run the request as a task the table owns; await its outcome."""
        self._check_accepting()
        check_identifier(cmd.request_id, "request_id")
        check_identifier(cmd.remote_engine_id, "remote_engine_id")
        if not cmd.peer_address:
            raise invalid("peer_address: the peer broker's address is required")
        engine = self.registry.get(cmd.engine_id)
        kinds = check_components(cmd.components, "components")
        num_pages = registered_pages(engine.layout, kinds)
        check_page_ids(cmd.src_page_ids, "src_page_ids", num_pages, self.limits.max_pages_per_request,
                       unique=False)
        if cmd.dst_page_ids.size:
            check_page_ids(cmd.dst_page_ids, "dst_page_ids", np.iinfo(np.int64).max,
                           self.limits.max_pages_per_request, unique=True)
        budget = self.limits.transfer_timeout_s if timeout is None else min(timeout, self.limits.transfer_timeout_s)
        record = self.table.add_send(cmd.engine_id, cmd.request_id, kinds, peer=cmd.peer_address)
        caller_bound = timeout is not None and timeout <= self.limits.transfer_timeout_s
        record.task = asyncio.create_task(self._send(record, engine, cmd, budget, caller_bound),
                                          name=f"transfer {cmd.engine_id}/{cmd.request_id}")
        await asyncio.shield(record.task)
        status = record.snapshot()
        if status.state is State.FAILED:
            raise BrokerError(Code(status.code), status.reason)
        return status

    async def _send(self, record: TransferRecord, engine: Engine, cmd: TransferCommand, budget: float,
                    caller_bound: bool) -> None:
        """Handshake, rules, claim, plan, write, tell the receiver. `caller_bound`: the budget is the
        caller's deadline (its expiry is DEADLINE_EXCEEDED), not the broker's transfer_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        left = lambda: max(0.0, deadline - loop.time())  # noqa: E731
        token = ""
        reached_peer = False
        try:
            async with asyncio.timeout(budget):
                session = await self.peers.session(cmd.peer_address, cmd.remote_engine_id, refresh=False,
                                                   timeout=min(left(), self.limits.peer_rpc_timeout_s))
                reached_peer = True
                session = await self._apply_rules(engine, session, cmd, record.components, left)
                claimed = await self.peers.claim(session, cmd.request_id, record.components, cmd.dst_page_ids,
                                                 timeout=min(left(), self.limits.peer_rpc_timeout_s))
                token = claimed.grant.claim_token
                if (claimed.epoch, claimed.generation) != (session.epoch, session.generation):
                    session = await self.peers.session(cmd.peer_address, cmd.remote_engine_id, refresh=True,
                                                       timeout=min(left(), self.limits.peer_rpc_timeout_s))
                    topology.check_transfer(engine.layout, session.engine, record.components)
                src, dst, truncated = topology.truncate_page_lists(cmd.src_page_ids, claimed.grant.dst_page_ids)
                remote_pages = registered_pages(session.engine, record.components)
                # The receiver checked its grant; this guards our writes against a peer that lies about it.
                check_page_ids(dst, "dst_page_ids", remote_pages, self.limits.max_pages_per_request, unique=False)
                runs = plan_runs(src, dst)
                src_buffers = [b for k in record.components for b in engine.layout.components[k].buffers]
                dst_buffers = [b for k in record.components for b in session.engine.components[k].buffers]
                descriptors = build_descriptors(runs, src_buffers, dst_buffers)
                self.table.start(record)
                write_budget = min(left(), claimed.grant.remaining_s)
                try:
                    await self.backend.write(session.peer_handle, descriptors, write_budget)
                except TransferFailed as exc:
                    raise BrokerError(Code.ABORTED, f"transfer engine {self.backend.name}: {exc}") from exc
                except TimeoutError as exc:  # the caller's deadline, or an engine that stopped making progress
                    code = Code.DEADLINE_EXCEEDED if caller_bound and left() <= 0.01 else Code.ABORTED
                    raise BrokerError(code, f"transfer engine {self.backend.name}: {exc}") from exc
                record.pages, record.runs, record.bytes, record.truncated_pages = (
                    runs.pages, runs.count, descriptors.nbytes, truncated)
                state = await self.peers.complete(cmd.peer_address, cmd.remote_engine_id, cmd.request_id, token,
                                                  record.snapshot(),
                                                  timeout=min(left(), self.limits.peer_rpc_timeout_s))
                if state is not State.SUCCEEDED:
                    raise BrokerError(Code.ABORTED, f"receiver reports the grant as {state.name} after the write")
                self.table.succeed(record, pages=runs.pages, runs=runs.count, nbytes=descriptors.nbytes,
                                   truncated=truncated)
        except TimeoutError:
            self.table.fail(record, Code.DEADLINE_EXCEEDED if caller_bound else Code.UNAVAILABLE,
                            f"transfer did not complete within {budget:.3f}s")
        except BrokerError as exc:
            self.table.fail(record, exc.code, exc.message)
        except asyncio.CancelledError:
            self.table.fail(record, record.code or Code.CANCELLED, record.reason or "transfer was cancelled")
        except Exception as exc:  # a bug must end the request, not wedge it
            log.exception("transfer %s failed unexpectedly", cmd.request_id)
            self.table.fail(record, Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            record.task = None
            if record.state is State.FAILED and reached_peer:
                await self._tell_peer_failed(cmd, token, record)

    async def _apply_rules(self, engine: Engine, session: PeerSession, cmd: TransferCommand,
                           kinds: tuple[ComponentKind, ...], left) -> PeerSession:
        """Check every topology rule; a cached handshake that fails is refreshed once before refusing,
        since the peer engine may have re-registered since."""
        try:
            topology.check_transfer(engine.layout, session.engine, kinds)
            return session
        except BrokerError:
            fresh = await self.peers.session(cmd.peer_address, cmd.remote_engine_id, refresh=True,
                                             timeout=min(left(), self.limits.peer_rpc_timeout_s))
            if (fresh.epoch, fresh.generation) == (session.epoch, session.generation):
                raise
            topology.check_transfer(engine.layout, fresh.engine, kinds)
            return fresh

    async def _tell_peer_failed(self, cmd: TransferCommand, token: str, record: TransferRecord) -> None:
        if record.code == Code.PERMISSION_DENIED or record.code == Code.NOT_FOUND:
            return  # the grant refused us (or is not there): it is not ours to fail
        try:
            await asyncio.shield(self.peers.complete(cmd.peer_address, cmd.remote_engine_id, cmd.request_id,
                                                     token, record.snapshot(),
                                                     timeout=self.limits.peer_rpc_timeout_s))
        except (BrokerError, TimeoutError, asyncio.CancelledError) as exc:
            log.debug("could not tell %s that %s failed: %s", cmd.peer_address, cmd.request_id, exc)

    # -- both sides -----------------------------------------------------------------------------
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
            record.code, record.reason = int(code), reason  # _send fails the record with these
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
