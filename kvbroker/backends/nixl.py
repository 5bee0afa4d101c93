"""NIXL (UCX) backend: one agent per broker, peers loaded from handshake metadata.

Every call into the agent runs on one dedicated thread, so the agent is never entered
concurrently and the event loop never blocks. A write is posted on that thread, which then checks
its state for up to POST_SPIN_S and, if it ended, releases it there: a small write (a one-page part)
costs the event loop one hop to the thread. One still running is polled with a short backoff and
released by a last hop.
The agent's own progress thread (which must run: a receiving broker never calls into NIXL, yet
its UCX worker has to progress for transports such as TCP) waits in poll() for UCX events with
a timeout of nixl_progress_poll_ms, instead of NIXL's Python default of 0 that spins a core while
idle. NIXL wakes it at that period even when no event came, against a UCX bug that can leave a
descriptor unwoken: the period is the longest such a miss delays a receiver's progress, and each
wake-up is CPU an idle broker spends (at 1 ms, about 900 wake-ups and 16-19 ms of CPU a second
here; RESULTS.md, 2026-12-07).

With data_port_range, the agent is built with UCX_TCP_PORT_RANGE and UCX_NET_DEVICES set to it and
to the advertised host's interface plus the RDMA ports (ports.py), where the operator set neither.

A peer's metadata is loaded by `connect` as a remote agent of its own, keyed by the agent name it
carries and a digest of the whole metadata (`keyed_metadata`): handshakes that bring the same
metadata share the agent, and metadata NIXL cannot load never touches another key's state. NIXL
keeps what it loaded of a failed load (UCX's connection info, which remove_remote_agent does not
drop) and refuses the name from then on, and a failed load under a loaded name drops that agent:
a peer lying with a truncated copy of a real broker's metadata would otherwise cut the path to
that broker for good. The NIXL thread counts (base.PeerRefs), per remote agent, the connects not
yet matched by a disconnect and the writes posted and not yet released; the agent is removed when both reach
zero, so a peer that restarted leaves nothing behind and no write loses its endpoint mid-flight.

Each agent's name carries a random suffix: NIXL refuses new metadata under a name it has loaded,
and a restarted broker may well come back as the same broker id and pid (pid 1 of its container).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvbroker.backends import ports
from kvbroker.backends.base import Backend, BackendOptions, PeerRef, PeerRefs, TransferFailed
from kvbroker.backends.nixl_api import import_nixl_api
from kvbroker.core.model import Descriptors, MemoryKind, Region
from kvbroker.ops.thread_names import name_this_thread

log = logging.getLogger(__name__)

# After transfer() answers PROC, how long the NIXL thread keeps checking the state before it hands
# the write back to the event loop to poll: each poll and the release are one more hop, a wake-up of
# a loaded process. Over UCX shm a one-page part (10 KiB) is DONE when transfer() returns; over tcp on
# loopback 96-98% of them end within 200 us of it at load 1 (59-70% at load 7-9 on 2 cores), and
# waiting to 300 us adds 1% (3-5% loaded): the rest take milliseconds, for which the spin would only
# burn the thread (benchmarks/nixl_write_hops.py).
# check_xfer_state releases the GIL, so the spin does not hold up the event loop; it is far below the
# transfer timeouts brokers run with (seconds), and the event loop's deadline is checked after it.
POST_SPIN_S = 200e-6
POLL_FIRST_S = 20e-6
POLL_MAX_S = 1e-3
_agent_construction = threading.Lock()  # new_agent swaps a module attribute of the bindings
NIXL_MEMORY = {MemoryKind.HOST: "DRAM", MemoryKind.GPU: "VRAM"}


class RemoteAgents:
    """The remote agents NIXL has loaded and what the NIXL thread knows of each: the connects and
    posted transfers that hold it (PeerRefs), the metadata it was loaded from, and whether its UCX
    endpoint failed. Used on the NIXL thread only."""

    def __init__(self) -> None:
        self.agent: Any = None  # the local nixl_agent (nixl ships no types), once started
        self.peers: PeerRefs[None] = PeerRefs()  # remote agents loaded, uses = transfers posted
        self.loaded: dict[bytes, bytes] = {}  # remote agent -> the metadata it was loaded from
        self.broken: set[bytes] = set()  # remote agents whose endpoint failed (REMOTE_DISCONNECT)

    def outside(self, name: bytes, regions: Sequence[Region]) -> Region | None:
        """On the NIXL thread: the first of `regions` that no memory registered in the loaded remote
        agent `name` holds whole, or None. NIXL's own prep refuses such descriptors too, but only at
        write time, and only against the metadata, which the same peer hands us."""
        by_kind: dict[str, list[Region]] = {}
        for r in regions:
            by_kind.setdefault(NIXL_MEMORY[MemoryKind.GPU if r.gpu else MemoryKind.HOST], []).append(r)
        for kind, listed in by_kind.items():
            def holds(rs: list[Region], kind: str = kind) -> bool:
                descs = self.agent.get_xfer_descs([(r.address, r.length, r.device) for r in rs], kind)
                return self.agent.check_remote_metadata(name, descs)

            if not holds(listed):
                return next(r for r in listed if not holds([r]))
        return None

    def remove_if_idle(self, name: bytes) -> None:
        """On the NIXL thread: drop a remote agent nothing holds and nothing writes to."""
        if not self.peers.drop_if_idle(name):
            return
        self.loaded.pop(name, None)
        self.broken.discard(name)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # it stays loaded; nothing else refers to it
            log.warning("removing NIXL remote agent %r: %s", name, exc)
            return
        log.info("NIXL remote agent forgotten", extra=_held(name, self.peers))

    def reload_if_broken(self, name: bytes) -> None:
        """On the NIXL thread, before a transfer is posted: a remote agent whose UCX endpoint failed
        (NIXL_ERR_REMOTE_DISCONNECT: e.g. the receiver's copy of one engine's pages faulted) keeps
        failing every transfer to that broker, whatever engine it is for, until it is loaded afresh.
        Once no transfer to it is posted any longer, it is removed and loaded again from the same
        metadata, which makes a new endpoint; a failure here leaves it broken for the next try."""
        if name not in self.broken or self.peers.busy(name) or name not in self.loaded:
            return
        try:
            self.agent.remove_remote_agent(name)
            self.agent.add_remote_agent(self.loaded[name])
        except Exception as exc:  # nixl raises its own error types
            log.warning("reloading NIXL remote agent %r after its endpoint failed: %s", name, exc)
            return
        self.broken.discard(name)
        log.info("NIXL remote agent reloaded after its endpoint failed", extra=_held(name, self.peers))

    def note_failure(self, name: bytes, exc: BaseException) -> None:
        """On the NIXL thread: a transfer to `name` failed; a lost endpoint is reloaded before the next."""
        if "REMOTE_DISCONNECT" in f"{type(exc).__name__} {exc}" or "state ERR" in str(exc):
            self.broken.add(name)

    def clear(self) -> None:
        for name in self.peers:
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # the peer may be gone already
                log.debug("removing NIXL peer %r: %s", name, exc)
        self.peers.clear()
        self.loaded.clear()
        self.broken.clear()


@dataclass(frozen=True)
class Posted:
    """What posting a write left for the event loop. `handle` is None when the transfer ended on the
    NIXL thread and was released there: nothing is left to poll or release; `state` says how it
    ended, `failure` what check_xfer_state raised if it did."""

    handle: object | None
    counted: PeerRef[None] | None
    state: str
    failure: Exception | None = None

    def raise_failure(self) -> None:
        """For a transfer released on the NIXL thread: raise what it ended with, as a poll would."""
        if self.failure is not None:
            raise _failed("NIXL failed the transfer while it ran", self.failure) from self.failure
        if self.state != "DONE":
            raise _ended(self.state)


# UCX looks a region's memory type up in a cache that its allocation hooks fill, and takes a miss for
# host memory. A server-owned pool is memory this process only imported (cuIpcOpenMemHandle), never
# allocated, so it misses, and NIXL refuses to register it as VRAM ("VRAM memory is detected as host
# by UCX"; seen on an H200, benchmarks/RESULTS.md, GPU check). Without the cache UCX asks the CUDA
# driver (a pointer-attribute query) where it does not know the type; an operator's own setting wins.
UCX_MEMORY_TYPES = {"UCX_MEMTYPE_CACHE": "n"}


class NixlBackend(Backend):
    name = "nixl"

    def __init__(self, options: BackendOptions) -> None:
        self._agent_name = f"{options.agent_name}-{secrets.token_hex(4)}"
        self._progress_poll_us = options.nixl_progress_poll_ms * 1000
        self._environment = ports.ucx_environment(options.data_ports, options.advertised_host) \
            if options.data_ports else {}
        self._agent: Any = None  # nixl_agent, once started (nixl ships no types)
        self._settle_s = options.transfer_timeout_s  # how long a write past its timeout may still finish
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self._remotes = RemoteAgents()  # on the NIXL thread only
        self._peers = self._remotes.peers
        self._writing: PeerRefs[None] = PeerRefs()  # write() calls running per remote agent; on the event loop only

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        def create():
            api = import_nixl_api()
            nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
            _route_nixl_log()
            with ports.environment({**UCX_MEMORY_TYPES, **self._environment}) as applied:  # read as the agent is built
                return new_agent(nixl_agent, nixl_agent_config, self._agent_name, self._progress_poll_us), applied

        self._agent, applied = await self._call(create)
        self._remotes.agent = self._agent
        if self._environment:
            log.info("NIXL agent's UCX listeners confined", extra={
                "applied": {k: v for k, v in applied.items() if k in self._environment},
                "operator_set": sorted(set(self._environment) - set(applied))})

    async def register(self, regions: Sequence[Region]) -> object:
        by_kind: dict[str, list[tuple[int, int, int, str]]] = {}
        for r in regions:
            kind = NIXL_MEMORY[MemoryKind.GPU if r.gpu else MemoryKind.HOST]
            by_kind.setdefault(kind, []).append((r.address, r.length, r.device, ""))

        def register_all():
            return [self._agent.register_memory(descs, kind) for kind, descs in by_kind.items()]

        try:
            return await self._call(register_all)
        except Exception as exc:  # nixl raises its own error types
            raise _failed("NIXL refused to register memory", exc) from exc

    async def deregister(self, handle: object) -> None:
        def deregister_all():
            for reg in cast("list[object]", handle):  # what register returned
                self._agent.deregister_memory(reg)

        try:
            await self._call(deregister_all)
        except Exception as exc:  # nixl raises its own error types
            raise _failed("NIXL could not deregister memory", exc) from exc

    async def metadata(self) -> bytes:
        try:
            return await self._call(self._agent.get_agent_metadata)
        except Exception as exc:  # nixl raises its own error types
            raise _failed("NIXL could not give its metadata", exc) from exc

    def is_own(self, metadata: bytes) -> bool:
        try:
            key, _ = keyed_metadata(metadata)
        except TransferFailed:
            return False
        return key.rpartition(b"#")[0] == self._agent_name.encode()

    async def connect(self, metadata: bytes, regions: Sequence[Region] = ()) -> object:
        key, keyed = keyed_metadata(metadata)

        def load():
            # Loading the same metadata again (another engine of the same peer broker) is a no-op for NIXL.
            name = self._agent.add_remote_agent(keyed)
            outside = self._remotes.outside(name, regions)
            if outside is not None:
                if name not in self._peers:  # loaded for this handshake only: nothing else refers to it
                    try:
                        self._agent.remove_remote_agent(name)
                    except Exception as exc:  # it stays loaded, unreferenced
                        log.warning("removing NIXL remote agent %r: %s", name, exc)
                raise TransferFailed(
                    f"the peer's NIXL metadata registers no region holding its declared layer buffer "
                    f"[{outside.address:#x}, {outside.address + outside.length:#x}) "
                    f"({'GPU ' + str(outside.device) if outside.gpu else 'host'} memory)")
            if self._peers.connect(name):
                log.info("NIXL remote agent connected", extra=_held(name, self._peers))
            self._remotes.loaded[name] = keyed
            return name

        try:
            return await self._call(load)
        except Exception as exc:  # nixl raises its own error types for metadata it cannot load
            raise _failed("NIXL refused the peer's metadata", exc) from exc

    async def disconnect(self, peer: object) -> None:
        def unload():
            name = _remote_agent(peer)
            if not self._peers.disconnect(name):
                log.warning("NIXL disconnect of remote agent %r without a connect", name)
                return
            self._remotes.remove_if_idle(name)

        await self._call(unload)

    def _finish(self, peer: object, handle, counted: PeerRef[None] | None) -> None:
        """On the NIXL thread: release a transfer; a transfer NIXL could not release keeps its agent."""
        if _release(self._agent, handle) and counted is not None:
            self._peers.end(counted)
            self._remotes.remove_if_idle(_remote_agent(peer))

    def writing(self, peer: object) -> bool:
        return self._writing.busy(peer)

    async def write(self, peer: object, descriptors: Descriptors, timeout: float) -> None:
        running = self._writing.begin(peer)
        try:
            await self._write(peer, descriptors, timeout)
        finally:
            self._writing.end(running)
            self._writing.drop_if_idle(peer)

    async def _write(self, peer: object, descriptors: Descriptors, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        src = np.ascontiguousarray(descriptors.src)
        dst = np.ascontiguousarray(descriptors.dst)
        src_kind, dst_kind = NIXL_MEMORY[descriptors.src_memory_kind], NIXL_MEMORY[descriptors.dst_memory_kind]
        name = _remote_agent(peer)

        def post() -> Posted:
            self._remotes.reload_if_broken(name)
            local = self._agent.get_xfer_descs(src, src_kind)
            remote = self._agent.get_xfer_descs(dst, dst_kind)
            try:
                handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
            except Exception as exc:
                self._remotes.note_failure(name, exc)
                raise
            counted = self._peers.begin(peer) if peer in self._peers else None
            try:
                state = self._agent.transfer(handle)
            except BaseException as exc:
                self._remotes.note_failure(name, exc)
                self._finish(peer, handle, counted)
                raise
            state, failure = settle_at_post(self._agent, handle, state)
            if state == "PROC" and failure is None:
                return Posted(handle, counted, state)  # the event loop polls it, and releases it
            if failure is not None or state != "DONE":
                self._remotes.note_failure(name, failure if failure is not None else _ended(state))
            self._finish(peer, handle, counted)
            return Posted(None, None, state, failure)

        posting = loop.run_in_executor(self._executor, post)
        try:
            posted = await asyncio.shield(posting)
        except asyncio.CancelledError:
            # The post runs to its end on the NIXL thread; what it started is released there.
            posting.add_done_callback(lambda f: None if f.cancelled() or f.exception() else self._finish_later(peer, f))
            raise
        except Exception as exc:  # nixl raises its own error types for refused descriptors
            raise _failed("NIXL refused the transfer", exc) from exc
        if posted.handle is None:  # ended and released on the NIXL thread
            posted.raise_failure()
            return
        handle, counted, state = posted.handle, posted.counted, posted.state
        try:
            state = await self._poll(peer, handle, state, deadline)
            if state == "PROC":
                # Past its timeout the transfer may still be writing the peer's pages, which its
                # receiver takes back once told of the failure: let it end first (bounded), and only
                # then release, which aborts what is left.
                state = await self._poll(peer, handle, state, loop.time() + self._settle_s)
                ended = "still in progress" if state == "PROC" else f"then ended {state}"
                raise TimeoutError(f"NIXL transfer still in progress after {timeout:.3f}s ({ended})")
            if state != "DONE":
                failed = _ended(state)
                await self._call(self._remotes.note_failure, name, failed)
                raise failed
        finally:
            await asyncio.shield(self._call(self._finish, peer, handle, counted))

    async def _poll(self, peer: object, handle, state: str, deadline: float) -> str:
        """The transfer's state once it left PROC, or PROC at `deadline`."""
        loop = asyncio.get_running_loop()
        delay = POLL_FIRST_S
        while state == "PROC" and loop.time() < deadline:
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(delay * 2, POLL_MAX_S)
            try:
                state = await self._call(self._agent.check_xfer_state, handle)
            except Exception as exc:  # e.g. nixlRemoteDisconnectError: the receiver went mid-write
                await self._call(self._remotes.note_failure, _remote_agent(peer), exc)
                raise _failed("NIXL failed the transfer while it ran", exc) from exc
        return state

    def _finish_later(self, peer: object, posting: asyncio.Future[Posted]) -> None:
        posted = posting.result()
        if posted.handle is None:  # released on the NIXL thread already
            return
        try:
            self._executor.submit(self._finish, peer, posted.handle, posted.counted)
        except RuntimeError:  # the executor is shut down: close() removed every agent already
            pass

    async def close(self) -> None:
        def teardown():
            self._remotes.clear()
            self._agent = self._remotes.agent = None

        if self._agent is not None:
            await self._call(teardown)
        self._executor.shutdown(wait=True)


def _remote_agent(peer: object) -> bytes:
    """A peer handle as `connect` returned it: the name NIXL gave the loaded remote agent."""
    return cast(bytes, peer)


def _route_nixl_log() -> None:
    """NIXL logs to stdout through its own handler; route it through ours (stderr, our format)."""
    nixl_log = logging.getLogger("nixl")
    nixl_log.handlers.clear()
    nixl_log.propagate = True
    nixl_log.setLevel(max(logging.getLogger().level, logging.INFO))


def new_agent(nixl_agent, nixl_agent_config, name: str, poll_us: int = 1000):
    """A UCX agent whose progress thread sleeps in poll() between events, at most `poll_us` (NIXL
    rounds it up to whole milliseconds; its Python wrapper hard-codes 0, a zero timeout, so the
    thread would never sleep).

    nixl_agent_config exposes no progress-thread delay and nixl_agent sets the bindings' pthrDelay
    to 0 just before constructing the native agent, so the native constructor is wrapped for the
    duration of this one call to set the delay first. If the bindings are not shaped as expected,
    the agent is built as NIXL would build it. The calling thread (the NIXL call thread) then takes
    its Python name for the kernel (ops/thread_names.py).
    """
    bindings = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    native = getattr(bindings, "nixlAgent", None)
    if bindings is None or native is None:
        log.warning("NIXL bindings without nixlAgent: the progress thread keeps NIXL's zero poll timeout")
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))

    def with_poll_timeout(agent_name, config):
        config.pthrDelay = poll_us
        return native(agent_name, config)

    with _agent_construction:
        bindings.nixlAgent = with_poll_timeout
        try:
            agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            bindings.nixlAgent = native
    name_this_thread()  # now: the agent's threads, started from this one, keep the name it had (`python`)
    return agent


def settle_at_post(agent, handle, state: str) -> tuple[str, Exception | None]:
    """On the NIXL thread, just after transfer() answered `state`: the state once it left PROC or
    POST_SPIN_S passed, and what check_xfer_state raised if it did."""
    until = time.perf_counter() + POST_SPIN_S
    try:
        while state == "PROC" and time.perf_counter() < until:
            state = agent.check_xfer_state(handle)
    except Exception as exc:  # e.g. nixlRemoteDisconnectError: the receiver went mid-write
        return state, exc
    return state, None


def _ended(state: str) -> TransferFailed:
    """A transfer that left PROC other than DONE, as the broker reports it."""
    return TransferFailed(f"NIXL reported transfer state {state}")


def _failed(what: str, exc: Exception) -> TransferFailed:
    """An exception of the nixl bindings as the broker reports it: what failed, in NIXL's words."""
    return TransferFailed(f"{what}: {type(exc).__name__}: {exc}")


AGENT_HEADER = b"nixlSerDes|Agent"  # NIXL's serialized metadata opens with its agent's name, length-prefixed
MAX_AGENT_NAME = 1024


def keyed_metadata(metadata: bytes) -> tuple[bytes, bytes]:
    """The remote agent's key, its name with a digest of `metadata` (`name#digest`), and the metadata
    renamed to that key. TransferFailed for bytes that do not open as NIXL agent metadata."""
    start = len(AGENT_HEADER) + 8
    size = int.from_bytes(metadata[len(AGENT_HEADER):start], "little") if len(metadata) >= start else 0
    end = start + size
    if not metadata.startswith(AGENT_HEADER) or not 0 < size <= MAX_AGENT_NAME or metadata[end:end + 1] != b"|":
        raise TransferFailed(f"NIXL metadata of {len(metadata)} bytes does not open with an agent name")
    key = metadata[start:end] + b"#" + hashlib.blake2b(metadata, digest_size=8).hexdigest().encode()
    return key, AGENT_HEADER + len(key).to_bytes(8, "little") + key + metadata[end:]


def _release(agent, handle) -> bool:
    try:
        agent.release_xfer_handle(handle)
        return True
    except Exception as exc:  # an in-flight handle NIXL cannot abort stays on the agent's leak list
        log.warning("releasing NIXL transfer handle: %s", exc)
        return False


def _held(name: bytes, peers: PeerRefs) -> dict:
    """Log fields: the remote agent concerned and how many this agent now holds."""
    return {"remote_peer": name.decode(errors="replace") if isinstance(name, bytes) else str(name),
            "remote_peers": len(peers)}

