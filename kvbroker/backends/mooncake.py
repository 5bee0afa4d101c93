"""Mooncake Transfer Engine backend: one engine per broker, P2P handshake, writes polled with sleeps.

The engine is initialised in P2P-handshake mode (no metadata server) on the host peers reach this
broker by; its session id, "host:rpc_port", is the handshake metadata and the peer handle. Control
calls (initialise, register, teardown) run on one dedicated thread; writes run on a small pool,
because submitting one may block (the engine opens the peer's segment, a handshake, on the first
write to it). A request is cut into batches of at most BATCH_DESCRIPTORS rows and at most
PEER_WINDOW batches are in flight towards one peer, so the TCP transport's per-peer queue (1024
transfers unless MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER says otherwise) never overflows, however
fragmented the request and however many run at once.

A writer thread submits each descriptor of its batch (transfer_submit_write) and polls their ends
oldest first (transfer_check_status), sleeping between polls (POLL_FIRST_S, doubling up to
POLL_MAX_S). The engine's batch_transfer_sync_write polls its batch's status in a loop that never
sleeps: a core spun for the whole write, which doubled the CPU of a one-page write here.

The engine gives up a synchronous batch after MC_TRANSFER_TIMEOUT seconds plus 1 ns per byte of the
batch, reading the variable once, when the engine object is constructed (whole seconds, at least 5);
a writer thread gives up polling its batch after the same limit. `start` sets it for that moment to
the broker's transfer_timeout_s, unless the operator set it, so that neither gives up on a batch the
broker still waits for, and a batch the broker gave up on ends soon after; deregistration and close
wait for batches that long.

With data_port_range, `mooncake.engine` is first imported with MC_MIN_RPC_PORT/MC_MAX_RPC_PORT set
to it (ports.py): the engine reads its port range then, once per process. Its handshake and data
listeners bind 0.0.0.0 and [::] whatever it is told, which start says once in the log.

A peer's session id is counted like any peer handle (base.py); when nothing holds or writes to it
any longer, its window goes. The engine's own cache of the peer's segment (opened on the first
write) stays until the engine is destroyed: the Python binding has no call that closes a segment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from kvbroker.backends import ports
from kvbroker.backends.base import Backend, BackendOptions, PeerRefs, TransferFailed
from kvbroker.core.model import Descriptors, Region
from kvbroker.ops.thread_names import name_this_thread, named_pool

log = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
BATCH_DESCRIPTORS = 512
PEER_WINDOW = 2  # batches in flight per peer: BATCH_DESCRIPTORS * PEER_WINDOW stays within the TCP queue
WRITER_THREADS = 4
TRANSFER_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
ENGINE_MIN_TIMEOUT_S = 5  # the engine raises smaller values to this
QUIESCE_SLACK_S = 5.0  # beyond the engine's own limit: the writer thread's return to us
POLL_FIRST_S = 50e-6  # a writer thread's first sleep between polls of a batch's ends; doubled each time
POLL_MAX_S = 1e-3  # ... up to this
NOT_SUBMITTED = frozenset({0, -1, 2**64 - 1})  # transfer_submit_write's "no batch" (0 when the peer is unreachable)
_engine_construction = threading.Lock()  # the environment is the process's: one engine constructed at a time


def engine_timeout_s(transfer_timeout_s: float, configured: str | None) -> int:
    """MC_TRANSFER_TIMEOUT as the engine will apply it, in whole seconds: the operator's value when set
    (parsed as the engine's atoi parses it), else the broker's transfer_timeout_s rounded up."""
    if configured:
        digits = re.match(r"\s*[+-]?\d+", configured)
        seconds = int(digits.group()) if digits else 0
    else:
        seconds = math.ceil(transfer_timeout_s)
    return max(ENGINE_MIN_TIMEOUT_S, seconds)


def quiesce_timeout_s(engine_timeout: int, batch_bytes: int) -> float:
    """How long a batch of `batch_bytes` may still run after it was handed to the engine: the engine's
    limit, MC_TRANSFER_TIMEOUT plus 1 ns per byte, and a little slack for the thread to return."""
    return engine_timeout + batch_bytes * 1e-9 + QUIESCE_SLACK_S


class MooncakeBackend(Backend):
    name = "mooncake"

    def __init__(self, options: BackendOptions) -> None:
        self._agent_name = options.agent_name
        self._host = options.advertised_host
        self._protocol = options.mooncake_protocol
        self._device = options.mooncake_device
        configured = os.environ.get(TRANSFER_TIMEOUT_ENV)
        self._set_timeout = not configured
        self._engine_timeout = engine_timeout_s(options.transfer_timeout_s, configured)
        if configured and self._engine_timeout < options.transfer_timeout_s:
            log.warning("%s=%s: the Mooncake engine abandons a batch after %d s, before transfer_timeout_s (%g s)",
                        TRANSFER_TIMEOUT_ENV, configured, self._engine_timeout, options.transfer_timeout_s)
        self._environment = ports.mooncake_environment(options.data_ports) if options.data_ports else {}
        self._engine: Any = None  # mooncake.engine's TransferEngine (untyped), once started
        self._session = ""
        self._control = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mooncake")
        self._writers = named_pool(WRITER_THREADS, "mooncake-write")
        # Per peer session, on the event loop: connects, uses (write() calls running and batches the
        # engine may still be moving), and its window of batches in flight.
        self._peers: PeerRefs[asyncio.Semaphore] = PeerRefs(lambda: asyncio.Semaphore(PEER_WINDOW))
        self._inflight: dict[concurrent.futures.Future, int] = {}  # batches the engine may still be moving: bytes

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._control, fn, *args)

    async def start(self) -> None:
        def create():
            TransferEngine = self._import_engine()  # noqa: N806 (the library's class)
            engine = self._construct(TransferEngine)
            rc = engine.initialize(self._host, P2P_HANDSHAKE, self._protocol, self._device)
            if rc != 0:
                raise TransferFailed(f"Mooncake initialize(host={self._host!r}, protocol={self._protocol!r}, "
                                     f"device={self._device!r}) returned {rc}")
            name_this_thread()  # after the engine's threads started from it, which keep the name it had
            return engine, f"{self._host}:{engine.get_rpc_port()}"

        self._engine, self._session = await self._call(create)
        log.debug("Mooncake engine %s serving session %s over %s, abandoning a batch after %d s",
                  self._agent_name, self._session, self._protocol, self._engine_timeout)

    def _import_engine(self):
        """mooncake.engine's TransferEngine; imported for the first time with data_port_range's ports
        in MC_MIN_RPC_PORT/MC_MAX_RPC_PORT, which the engine reads then, once per process."""
        first = "mooncake.engine" not in sys.modules
        with ports.environment(self._environment if first else {}) as applied:
            from mooncake.engine import TransferEngine
        if self._environment:
            if not first and any(os.environ.get(k) != v for k, v in self._environment.items()):
                log.warning("mooncake.engine was imported before in this process: its port range stays what "
                            "it read then, not data_port_range")
            log.info("Mooncake listens on every interface (0.0.0.0 and [::]) whatever it is told; "
                     "data_port_range confines its ports only: fence them (README.md, Security)",
                     extra={"applied": applied,
                            "operator_set": sorted(set(self._environment) - set(applied)) if first else []})
        return TransferEngine

    def _construct(self, engine_class):
        """The engine, constructed while MC_TRANSFER_TIMEOUT says what we want; the variable is put back."""
        if not self._set_timeout:
            return engine_class()
        with _engine_construction:
            before = os.environ.get(TRANSFER_TIMEOUT_ENV)
            os.environ[TRANSFER_TIMEOUT_ENV] = str(self._engine_timeout)
            try:
                return engine_class()
            finally:
                if before is None:
                    del os.environ[TRANSFER_TIMEOUT_ENV]
                else:
                    os.environ[TRANSFER_TIMEOUT_ENV] = before

    async def register(self, regions: Sequence[Region]) -> object:
        def register_all():
            done: list[int] = []
            for r in regions:
                # GPU memory is named by its device; for host memory "*" lets the engine find the NUMA node.
                location = f"cuda:{r.device}" if r.gpu else "*"
                try:
                    rc = self._engine.register_memory(r.address, r.length, location)
                except Exception as exc:  # the binding raises for arguments it cannot take
                    _unregister(self._engine, done)
                    raise _failed(f"Mooncake register_memory({r.address:#x}, {r.length}, {location!r})", exc) from exc
                if rc != 0:
                    _unregister(self._engine, done)
                    raise TransferFailed(f"Mooncake register_memory({r.address:#x}, {r.length}, {location!r}) "
                                         f"returned {rc}")
                done.append(r.address)
            return done

        return await self._call(register_all)

    async def deregister(self, handle: object) -> None:
        await self._quiesce()  # a batch cut short by a timeout may still be reading this memory
        await self._call(_unregister, self._engine, handle)

    async def metadata(self) -> bytes:
        return self._session.encode()

    def is_own(self, metadata: bytes) -> bool:
        """Our session id, also under another name of this host (loopback, any-address, our host)."""
        host, _, port = metadata.decode(errors="replace").strip().rpartition(":")
        own_host, _, own_port = self._session.rpartition(":")
        local = {own_host, "localhost", "0.0.0.0", "::", "[::]", "::1", "[::1]"}
        return bool(port) and port == own_port and (host in local or host.startswith("127."))

    async def connect(self, metadata: bytes, regions: Sequence[Region] = ()) -> object:
        # The engine opens the peer's segment (its handshake) on the first write and caches it. The
        # metadata names no memory: the peer's own engine checks each write's address against the
        # memory registered with it (transports.py), so `regions` have nothing to be checked against.
        session = metadata.decode(errors="replace")
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise TransferFailed(f"Mooncake peer metadata {session!r} is not a host:port session id")
        if self._peers.connect(session):
            log.info("Mooncake peer session connected", extra=self._held(session))
        return session

    async def disconnect(self, peer: object) -> None:
        session = _session(peer)
        if not self._peers.disconnect(session):
            log.warning("Mooncake disconnect of peer session %r without a connect", session)
            return
        self._forget_if_idle(session)

    def _forget_if_idle(self, session: str) -> None:
        if self._peers.drop_if_idle(session):
            log.info("Mooncake peer session forgotten", extra=self._held(session))

    def _held(self, session: str) -> dict:
        """Log fields: the peer session concerned and how many this backend now holds."""
        return {"remote_peer": session, "remote_peers": len(self._peers)}

    def writing(self, peer: object) -> bool:
        return self._peers.busy(peer)

    async def write(self, peer: object, descriptors: Descriptors, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        session = _session(peer)
        held = self._peers.begin(session)
        window = held.state
        assert window is not None  # made by the PeerRefs' factory
        running: list[concurrent.futures.Future] = []
        try:
            async with asyncio.timeout(timeout):
                for start in range(0, descriptors.count, BATCH_DESCRIPTORS):
                    await window.acquire()  # the peer's window
                    running.append(self._submit(loop, window, session, descriptors, start))
                    running = _pending_or_raise(running)
                await asyncio.gather(*map(_wrap, running))
        except TransferFailed:
            # Let the sibling batches land before the receiver hears of the failure and reuses its pages.
            if running:
                await asyncio.wait(list(map(_wrap, running)), timeout=max(0.0, deadline - loop.time()))
            raise
        except TimeoutError:
            # Batches the engine is moving still write the peer's pages, which its receiver takes back
            # once told of the failure: let them end first (the engine abandons one within its timeout).
            left = await self._settle(running)
            ended = f"{left} batches still in the engine" if left else "its batches then ended"
            raise TimeoutError(f"Mooncake write of {descriptors.count} descriptors to {peer} still in "
                               f"progress after {timeout:.3f}s ({ended})") from None
        finally:
            for future in running:
                future.cancel()  # only batches still queued for a thread; running ones finish in the engine
            self._peers.end(held)
            self._forget_if_idle(session)

    def _submit(self, loop: asyncio.AbstractEventLoop, window: asyncio.Semaphore, peer: str,
                descriptors: Descriptors, start: int) -> concurrent.futures.Future:
        """Hand one batch to a writer thread; its window slot is freed when the engine is done with it."""
        stop = min(start + BATCH_DESCRIPTORS, descriptors.count)
        try:
            future = self._writers.submit(_write_batch, self._engine, peer, descriptors.src[start:stop],
                                          descriptors.dst[start:stop], start, descriptors.count, self._engine_timeout)
        except BaseException:
            window.release()
            raise
        self._inflight[future] = int(descriptors.src[start:stop, 1].sum())
        batch = self._peers.begin(peer)  # the peer stays until the engine is done with the batch

        def finished(f: concurrent.futures.Future) -> None:
            window.release()
            self._inflight.pop(f, None)
            self._peers.end(batch)
            self._forget_if_idle(peer)

        future.add_done_callback(lambda f: loop.call_soon_threadsafe(finished, f))
        return future

    async def _settle(self, running: list[concurrent.futures.Future]) -> int:
        """Wait until the engine is done with these batches (bounded); how many it still moves."""
        started = [f for f in running if not f.cancel()]  # a batch still queued for a thread never starts
        if not started:
            return 0
        timeout = quiesce_timeout_s(self._engine_timeout, max(self._inflight.get(f, 0) for f in started))
        _, pending = await asyncio.wait(list(map(_wrap, started)), timeout=timeout)
        return len(pending)

    async def _quiesce(self) -> None:
        if self._inflight:
            timeout = quiesce_timeout_s(self._engine_timeout, max(self._inflight.values()))
            _, pending = await asyncio.wait(list(map(_wrap, self._inflight)), timeout=timeout)
            if pending:
                log.warning("%d Mooncake batches still in flight after %.0fs", len(pending), timeout)

    async def close(self) -> None:
        await self._quiesce()

        def teardown():
            # Dropping the last reference runs the engine's destructor: segments closed, transports stopped.
            self._engine = None

        if self._engine is not None:
            await self._call(teardown)
        self._peers.clear()
        self._writers.shutdown(wait=True)
        self._control.shutdown(wait=True)


def _write_batch(engine, peer: str, src: np.ndarray, dst: np.ndarray, start: int, total: int,
                 engine_timeout_s: float) -> None:
    """On a writer thread: submit each descriptor, then wait for every submitted one to end (at most
    the engine's own limit for the batch: `engine_timeout_s` plus 1 ns per byte) before reporting a
    failure, so that none lands after it."""
    limit_s = engine_timeout_s + int(src[:, 1].sum()) * 1e-9
    submitted: list[int] = []
    refused: TransferFailed | None = None
    rows = zip(src[:, 0].tolist(), src[:, 1].tolist(), dst[:, 0].tolist(), strict=True)  # address, length, target
    for row, (address, length, target) in enumerate(rows):
        call = f"Mooncake transfer_submit_write to {peer} (descriptor {start + row} of {total})"
        try:
            batch = engine.transfer_submit_write(peer, address, target, length)
        except Exception as exc:  # the binding raises rather than returns for some failures
            refused = _failed(call, exc)
            break
        if batch in NOT_SUBMITTED:
            refused = TransferFailed(f"{call} returned {batch}: not submitted")
            break
        submitted.append(batch)
    ended = _await_ends(engine, peer, submitted, limit_s, f"descriptors {start}..{start + len(src) - 1} of {total}")
    failure = refused or ended
    if failure is not None:
        raise failure


def _await_ends(engine, peer: str, batches: list[int], limit_s: float, where: str) -> TransferFailed | None:
    """Poll the batches' ends oldest first (they mostly end in order), sleeping while the oldest runs;
    None when all completed, else what failed. Batches still running after `limit_s` are abandoned,
    as the engine's synchronous calls abandon theirs."""
    pending = deque(batches)
    deadline = time.monotonic() + limit_s
    pause = POLL_FIRST_S
    failed: dict[int, int] = {}  # by the engine's code: -1 failed, -2 timed out in the engine
    while pending:
        try:
            rc = engine.transfer_check_status(pending[0])
        except Exception as exc:  # noqa: BLE001 - counted as that batch's failure; the others are still waited for
            log.warning("Mooncake transfer_check_status of a write to %s raised %s: %s", peer, type(exc).__name__, exc)
            rc = -1
        if rc == 0:  # still running
            if time.monotonic() > deadline:
                return TransferFailed(f"Mooncake write to {peer} ({where}): {len(pending)} of {len(batches)} "
                                      f"descriptors still running after the engine's limit ({limit_s:.1f}s), "
                                      f"abandoned{f'; ended badly: {_codes(failed)}' if failed else ''}")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
            continue
        pending.popleft()
        if rc != 1:
            failed[rc] = failed.get(rc, 0) + 1
    if failed:
        return TransferFailed(f"Mooncake transfer_check_status of a write to {peer} ({where}) {_codes(failed)} "
                              f"(of {len(batches)} descriptors)")
    return None


def _codes(failed: dict[int, int]) -> str:
    return ", ".join(f"returned {code} for {count}" for code, count in sorted(failed.items()))


def _failed(call: str, exc: Exception) -> TransferFailed:
    """An exception of the Mooncake binding as the broker reports it: the call, in the engine's words."""
    return TransferFailed(f"{call} raised {type(exc).__name__}: {exc}")


def _wrap(future: concurrent.futures.Future) -> asyncio.Future:
    wrapped = asyncio.wrap_future(future)
    wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" warnings
    return wrapped


def _pending_or_raise(futures: list[concurrent.futures.Future]) -> list[concurrent.futures.Future]:
    """Drop the batches that succeeded; raise the first failure among those that finished."""
    pending = []
    for future in futures:
        if not future.done():
            pending.append(future)
        elif not future.cancelled() and (failure := future.exception()) is not None:
            raise failure
    return pending


def _session(peer: object) -> str:
    """A peer handle as `connect` returned it: the peer's session id."""
    return cast(str, peer)


def _unregister(engine, addresses: Sequence[int]) -> None:
    for address in addresses:
        try:
            rc = engine.unregister_memory(address)
        except Exception as exc:  # as for a non-zero return: logged, and the other regions still go
            log.warning("Mooncake unregister_memory(%#x) raised %s: %s", address, type(exc).__name__, exc)
            continue
        if rc != 0:  # nothing to undo: the region is gone from the engine's view either way
            log.warning("Mooncake unregister_memory(%#x) returned %d", address, rc)
