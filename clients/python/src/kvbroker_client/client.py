"""BrokerClient: the async client an inference server uses to talk to its local broker.

    client = await BrokerClient.connect("unix:/run/kvbroker/kvbroker.sock")   # or "127.0.0.1:50051"
    await client.register_engine(engine_id, topology, components)              # both sides, once

The decode-initiated (offered) flow, as a PD server runs it:

    await client.expect_transfer(engine_id, request_id, {Component.MAIN_KV: dst_kv, ...},
                                 sender_address=prefill_peer_address)          # decode: grant, offered to prefill
    await client.transfer_part(engine_id, request_id, {Component.MAIN_KV: src_chunk},
                               dst_offsets={Component.MAIN_KV: start}, last=False)   # prefill: one per chunk
    await client.transfer_part(engine_id, request_id, {...}, dst_offsets={...}, aux=aux_bytes,
                               last=True)                                      # the last part
    status = await client.wait(engine_id, request_id)                          # decode: status.aux on SUCCEEDED

The claimed flow, where the sender names the receiver:

    await client.expect_transfer(engine_id, request_id, dst_page_ids=dst_ids)  # decode side: the grant
    await client.transfer(engine_id, request_id, peer_address, remote_engine_id, src_page_ids)  # prefill side
    await client.wait(engine_id, request_id)                                   # either side; or watch()

    await client.cancel(...), await client.info(), await client.unregister_engine(...), await client.close()

The command stream: `transfer_part`, `transfer`, `expect_transfer`, `watch` and `wait` go as
commands on one long-lived Exchange stream to the broker (exchange.py) rather than a call each,
when the broker offers it; a broker without it (UNIMPLEMENTED) gets the unary RPCs, as does
`BrokerClient(..., exchange=False)`. Each command is checked and answered as its unary RPC is. A
stream that breaks fails the commands in flight on it with Unavailable (retried as the unary
calls are, below), the next call opens a new one, and a watch in flight is made again on it: the
broker fails the requests the broken stream carried (CANCELLED), and the watch reports that.

Every call has a deadline: `timeout` (unary calls) or `transfer_timeout` (transfer, watch, wait)
unless the call passes its own; it bounds the whole call, reconnection included. Failures raise
the typed errors of `kvbroker_client.errors`.

Sessions: by default the engines a client registers are held by a session (OpenSession), a
stream the client keeps open from its first registration until `close()`. When this process
exits or crashes, the stream ends and the broker unregisters the engines: nothing stays mapped or
registered in the broker's name. `BrokerClient(..., session=False)` registers engines that stay
until `unregister_engine`, whatever becomes of this process.

Broker restarts: the client remembers the engines it registered and the broker's epoch. When a
call fails with UNAVAILABLE, or with NOT_FOUND while it holds engines, it asks the broker for its
epoch (waiting for it to come back, within the call's deadline); a new epoch means a new broker
process (and a session that ended without the broker restarting means the same for our engines),
so it opens a new session, registers the engines again and retries the call once. `transfer` is
retried only after NOT_FOUND: after UNAVAILABLE it may have reached the old broker and half-run.
`info()` notices a new epoch the same way. Requests in flight at the restart are lost with the
old broker. Engines with broker-owned memory (`memory_ownership="broker"`) are not registered
again: their pool went with the old broker, so the server must register them itself and use the
new pool (`lost_engines` lists them; their calls raise NotFound saying so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

import grpc
import numpy as np

from kvbroker_client.errors import (
    BrokerError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Unavailable,
    Unknown,
    from_rpc_error,
    from_status,
)
from kvbroker_client.exchange import Exchange, ExchangeUnsupported, StreamBroken
from kvbroker_client.model import (
    BrokerInfo,
    Component,
    ComponentSpec,
    EngineInfo,
    Topology,
    TransferState,
    TransferStatus,
)
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_TRANSFER_TIMEOUT_S = 120.0
# How long the client waits for its broker to come back after the session broke, to register its
# engines again at once (a peer's offer may arrive before this process calls again).
REJOIN_WINDOW_S = 60.0
# A sidecar on loopback or a Unix socket comes back within seconds: probe it often, not with
# gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)

ComponentLike = Component | int | str
_OWNERSHIP = {"server": bpb.MEMORY_OWNERSHIP_SERVER, "broker": bpb.MEMORY_OWNERSHIP_BROKER}
PageIds = Sequence[int] | np.ndarray
EXCHANGED = {"Transfer": "transfer", "ExpectTransfer": "expect"}  # the unary RPCs the Exchange stream carries


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"kvbroker_client: {old} is deprecated; use {new} (the old form goes in the next release)",
                  DeprecationWarning, stacklevel=3)


def _page_ids(ids: PageIds, field_name: str) -> list[int]:
    array = np.asarray(ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidArgument(f"{field_name}: expected a 1-D sequence of integer page ids")
    if array.size and (array.min() < 0 or array.max() >= 1 << 32):
        bad = int(np.flatnonzero((array < 0) | (array >= 1 << 32))[0])
        raise InvalidArgument(f"{field_name}[{bad}]: page id {int(array[bad])} is outside [0, 2**32)")
    return array.astype(np.int64).tolist()


def _components(components: Iterable[ComponentLike]) -> list[int]:
    return [int(Component.of(c)) for c in components]


def _topology(topology: Topology | pb.Topology) -> pb.Topology:
    return topology.to_proto() if isinstance(topology, Topology) else topology


def _component_spec(spec: ComponentSpec | pb.ComponentSpec) -> pb.ComponentSpec:
    return spec.to_proto() if isinstance(spec, ComponentSpec) else spec


class BrokerClient:
    """An async client of one broker's BrokerService. Create it inside a running event loop."""

    def __init__(self, target: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                 transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT_S,
                 channel_options: Sequence[tuple[str, object]] = (), session: bool = True,
                 holder: str = "", exchange: bool = True) -> None:
        """`session`: hold registered engines by a session (see the module's map); `holder` names this
        process in the broker's logs and GetBrokerInfo (default: host and pid); `exchange`: send
        transfers, grants and watches on the Exchange stream when the broker offers it."""
        self.target = target
        self.timeout = timeout
        self.transfer_timeout = transfer_timeout
        options = dict(CHANNEL_OPTIONS)
        options.update(channel_options)
        self._channel = grpc.aio.insecure_channel(target, options=list(options.items()))
        self._stub = bpb_grpc.BrokerServiceStub(self._channel)
        self.exchange = Exchange(self._stub, target) if exchange else None
        self._engines: dict[str, bpb.RegisterEngineRequest] = {}  # what to register again after a restart
        self._lost: set[str] = set()  # broker-owned engines a restart took with it
        self._epoch: int | None = None
        self._recovery = asyncio.Lock()
        self.restarts_seen = 0
        self._use_session = session
        self.holder = holder or f"{socket.gethostname()} pid {os.getpid()}"
        self._session_id = ""  # empty: no session open (none yet, or it ended)
        self._session_call: grpc.aio.UnaryStreamCall | None = None
        self._session_task: asyncio.Task | None = None  # reads the stream, to learn when it ends
        self._session_lock = asyncio.Lock()
        self._rejoin: asyncio.Task | None = None  # registers the engines again once a broken session's broker answers

    @classmethod
    async def connect(cls, target: str, **kwargs) -> BrokerClient:
        """A client whose broker has answered; Unavailable when none does within `timeout`."""
        client = cls(target, **kwargs)
        try:
            await client.info(wait_for_ready=True)
        except DeadlineExceeded as exc:
            await client.close()
            raise Unavailable(f"no broker answered at {target} within {client.timeout}s") from exc
        except BaseException:
            await client.close()
            raise
        return client

    async def close(self) -> None:
        """Close the channel. With a session, the broker then unregisters this client's engines."""
        rejoin, self._rejoin = self._rejoin, None
        if rejoin is not None:
            rejoin.cancel()
            await asyncio.gather(rejoin, return_exceptions=True)
        await self._end_session()
        if self.exchange is not None:
            await self.exchange.close()
        await self._channel.close()

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def epoch(self) -> int | None:
        """The broker epoch last seen; None before the first answer."""
        return self._epoch

    @property
    def registered_engines(self) -> tuple[str, ...]:
        return tuple(self._engines)

    @property
    def session_id(self) -> str:
        """The open session holding this client's engines; empty when none is open."""
        return self._session_id

    @property
    def lost_engines(self) -> tuple[str, ...]:
        """Broker-owned engines a broker restart released; register them again to get a new pool."""
        return tuple(sorted(self._lost))

    # -- the API -------------------------------------------------------------------------------
    async def info(self, *, timeout: float | None = None, wait_for_ready: bool = False) -> BrokerInfo:
        """The broker's identity, engines, peers and counters. Re-registers engines after a restart."""
        deadline = self._deadline(timeout, self.timeout)
        reply = await self._unary("GetBrokerInfo", bpb.GetBrokerInfoRequest(), deadline,
                                  wait_for_ready=wait_for_ready)
        if self._epoch is None:
            self._epoch = reply.epoch
        elif reply.epoch != self._epoch:
            await self._recover(deadline, seen=reply)
            reply = await self._unary("GetBrokerInfo", bpb.GetBrokerInfoRequest(), deadline)
        return BrokerInfo.from_proto(reply)

    async def register_engine(self, engine_id: str, topology: Topology | pb.Topology,
                              components: Sequence[ComponentSpec | pb.ComponentSpec], *,
                              memory_ownership: str = "server", allocation_device: int = 0,
                              timeout: float | None = None) -> EngineInfo:
        """Register an engine; the client registers it again whenever the broker restarts.

        `memory_ownership="broker"`: the broker allocates one GPU pool on `allocation_device` (no
        layer buffer names memory) and the returned EngineInfo says where each buffer is in it;
        such an engine is not registered again after a restart (see `lost_engines`).
        """
        deadline = self._deadline(timeout, self.timeout)
        if memory_ownership not in _OWNERSHIP:
            raise InvalidArgument(f"memory_ownership: {memory_ownership!r} is not one of {sorted(_OWNERSHIP)}")
        if self._epoch is None:  # a restart can only be told from the epoch the engine was registered under
            await self.info(timeout=self._remaining(deadline))
        request = bpb.RegisterEngineRequest(engine_id=engine_id, topology=_topology(topology),
                                            components=[_component_spec(c) for c in components],
                                            memory_ownership=_OWNERSHIP[memory_ownership],
                                            allocation_device=allocation_device)
        request.session_id = await self._session(deadline)
        reply = await self._unary("RegisterEngine", request, deadline)
        self._engines[engine_id] = request
        self._lost.discard(engine_id)
        return EngineInfo.from_proto(reply.engine)

    async def unregister_engine(self, engine_id: str, *, timeout: float | None = None) -> int:
        """Release an engine; returns the number of its requests that were failed by it."""
        if engine_id in self._lost:
            self._lost.discard(engine_id)
            return 0  # the restart that lost its pool released it
        ours = self._engines.pop(engine_id, None) is not None
        deadline, epoch = self._deadline(timeout, self.timeout), self._epoch
        try:
            reply = await self._unary("UnregisterEngine", bpb.UnregisterEngineRequest(engine_id=engine_id), deadline)
        except NotFound:
            if ours and await self._recover(deadline, since=epoch):
                return 0  # the broker restarted: the engine went with the old process
            raise
        return reply.failed_requests

    async def expect_transfer(self, engine_id: str, request_id: str,
                              dst_pages: Mapping[ComponentLike, PageIds] | None = None, *,
                              sender_address: str = "", sender_engine_id: str = "", expiry_s: float | None = None,
                              timeout: float | None = None, dst_page_ids: PageIds = (),
                              components: Iterable[ComponentLike] = (Component.MAIN_KV,),
                              pages: Mapping[ComponentLike, PageIds] | None = None,
                              src_offsets: Mapping[ComponentLike, int] | None = None) -> TransferStatus:
        """Receiver side: grant a peer the right to write these destination pages until expiry.

        The offered flow: `dst_pages` maps each component to its destination page ids, and
        `sender_address` (the prefill broker's peer address, its `info().peer_address`) names the
        broker the grant is offered to before this returns; only it may write the grant (only its
        engine `sender_engine_id`, when given), with `transfer_part`. The claimed flow (the sender
        names this broker, with `transfer`): `dst_page_ids`, one list for every one of `components`.
        `expiry_s` None takes the broker's default grant lifetime. `src_offsets` (offered flow): per
        component, the position in the sender's page sequence whose page lands on the grant's first
        entry; the sender's pages before it are not written (the receiver holds them already).

        Deprecated, kept for a release: `pages=` (now `dst_pages=`), and a page list as the third
        positional argument (now `dst_page_ids=`); each warns (DeprecationWarning).
        """
        if pages is not None:
            _deprecated("expect_transfer(pages=...)", "dst_pages=...")
            if dst_pages is not None:
                raise InvalidArgument("pages: give dst_pages (pages is its old name), not both")
            dst_pages = pages
        if dst_pages is not None and not isinstance(dst_pages, Mapping):
            _deprecated("expect_transfer(engine_id, request_id, page_ids)", "dst_page_ids=page_ids")
            if len(dst_page_ids):
                raise InvalidArgument("dst_page_ids: given twice (positionally and by name)")
            dst_pages, dst_page_ids = None, dst_pages
        request = bpb.ExpectTransferRequest(
            request_id=request_id, engine_id=engine_id, sender_address=sender_address,
            sender_engine_id=sender_engine_id, expiry_ms=0 if expiry_s is None else max(1, round(expiry_s * 1000)),
        )
        if dst_pages is not None:
            if len(dst_page_ids):
                raise InvalidArgument("dst_page_ids: give either dst_page_ids or dst_pages, not both")
            offsets = {Component.of(c): int(o) for c, o in (src_offsets or {}).items()}
            if stray := sorted(c.name for c in set(offsets) - {Component.of(c) for c in dst_pages}):
                raise InvalidArgument(f"src_offsets: {', '.join(stray)} not in dst_pages")
            request.pages.extend(pb.ComponentPages(component=int(Component.of(c)),
                                                   page_ids=_page_ids(ids, f"dst_pages[{Component.of(c).name}]"),
                                                   src_offset=offsets.get(Component.of(c), 0))
                                 for c, ids in dst_pages.items())
        else:
            if src_offsets:
                raise InvalidArgument("src_offsets: for a grant with a page list per component (dst_pages)")
            request.components.extend(_components(components))
            request.dst_page_ids.extend(_page_ids(dst_page_ids, "dst_page_ids"))
        reply = await self._unary("ExpectTransfer", request, self._deadline(timeout, self.timeout))
        return TransferStatus.from_proto(reply.status)

    async def transfer_part(self, engine_id: str, request_id: str,
                            src_pages: Mapping[ComponentLike, PageIds] | None = None, *, last: bool | None = None,
                            dst_offsets: Mapping[ComponentLike, int] | None = None, aux: bytes = b"",
                            receiver_broker_id: str = "", timeout: float | None = None,
                            pages: Mapping[ComponentLike, PageIds] | None = None) -> TransferStatus:
        """Sender side of the offered flow: write one part of a grant the receiver offered to this
        broker; returns once the receiver was told (after the last part: the request's final state).

        `src_pages` maps each component to its source page ids; they land on the grant's list of
        that component from entry `dst_offsets[component]` (0 when not given). `last` says whether
        this is the last part (`last=False` for every chunk that more follow); the last part may
        carry `aux` bytes for the receiver. If the offer has not reached this broker yet, the broker
        waits for it (bounded by its offer_wait_s). `receiver_broker_id` names the receiving broker
        (its broker id) whose offer the part is for; empty takes the one offer for the request id,
        refused while several receivers offered it.

        Deprecated, kept for a release: `pages=` (now `src_pages=`), and leaving out `last` (it
        meant last=True); each warns (DeprecationWarning).
        """
        if pages is not None:
            _deprecated("transfer_part(pages=...)", "src_pages=...")
            if src_pages is not None:
                raise InvalidArgument("pages: give src_pages (pages is its old name), not both")
            src_pages = pages
        if src_pages is None:
            raise InvalidArgument("src_pages: the part's source page ids per component are required")
        if last is None:
            _deprecated("transfer_part() without last", "last=True or last=False")
            last = True
        offsets = {Component.of(c): int(o) for c, o in (dst_offsets or {}).items()}
        chosen = {Component.of(c) for c in src_pages}
        if stray := sorted(c.name for c in set(offsets) - chosen):
            raise InvalidArgument(f"dst_offsets: {', '.join(stray)} not in src_pages")
        request = bpb.TransferRequest(
            request_id=request_id, engine_id=engine_id, more_parts=not last, aux=bytes(aux),
            receiver_broker_id=receiver_broker_id,
            pages=[bpb.PartPages(component=int(Component.of(c)),
                                 src_page_ids=_page_ids(ids, f"src_pages[{Component.of(c).name}]"),
                                 dst_offset=offsets.get(Component.of(c), 0))
                   for c, ids in src_pages.items()],
        )
        reply = await self._unary("Transfer", request, self._deadline(timeout, self.transfer_timeout),
                                  retry_unavailable=False)
        return TransferStatus.from_proto(reply.status)

    async def transfer(self, engine_id: str, request_id: str, peer_address: str, remote_engine_id: str,
                       src_page_ids: PageIds, *, dst_page_ids: PageIds = (),
                       components: Iterable[ComponentLike] = (Component.MAIN_KV,),
                       timeout: float | None = None) -> TransferStatus:
        """Sender side: move pages to the peer broker's engine; returns once the receiver was told.

        `peer_address` is the receiving broker's peer address (its `info().peer_address`); empty
        `dst_page_ids` means the grant's pages. Raises the typed error of the failure.
        """
        request = bpb.TransferRequest(
            request_id=request_id, engine_id=engine_id, peer_address=peer_address,
            remote_engine_id=remote_engine_id, components=_components(components),
            src_page_ids=_page_ids(src_page_ids, "src_page_ids"),
            dst_page_ids=_page_ids(dst_page_ids, "dst_page_ids"),
        )
        reply = await self._unary("Transfer", request, self._deadline(timeout, self.transfer_timeout),
                                  retry_unavailable=False)
        return TransferStatus.from_proto(reply.status)

    async def watch(self, engine_id: str, request_id: str, *, timeout: float | None = None,
                    states_only: bool = False, terminal_only: bool = False,
                    offer_wait_s: float = 0.0) -> AsyncIterator[TransferStatus]:
        """The request's current state, then each change; ends after a terminal state. With
        `states_only`, each change of state only, not each part that lands (fewer messages; a
        broker that does not know the option sends them all). With `terminal_only`, the terminal
        state only, one message (a broker that does not know it sends the others too). With
        `offer_wait_s`, a sender's broker that does not hold the request yet waits that long (at
        most its offer_wait_s) for the receiver's offer naming the engine before NOT_FOUND (a broker
        before the option answers at once).

        A stream the broker cuts (it stopped before the request ended) raises Unavailable. On the
        Exchange stream, a watch left before its end (the caller stopped iterating, or the deadline
        passed) is cancelled on the broker, which also ends it at the deadline itself.
        """
        deadline = self._deadline(timeout, self.transfer_timeout)
        request = bpb.WatchTransferRequest(engine_id=engine_id, request_id=request_id, states_only=states_only,
                                           terminal_only=terminal_only,
                                           offer_wait_ms=max(0, round(offer_wait_s * 1000)))
        if self._exchanged():
            try:
                async with contextlib.aclosing(self._watch_exchanged(request, deadline)) as statuses:
                    async for status in statuses:
                        yield status
                return
            except ExchangeUnsupported:
                pass
        call = self._stub.WatchTransfer(request, timeout=self._remaining(deadline))
        try:
            async for reply in call:
                yield TransferStatus.from_proto(reply.status)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED:
                # Our own cancellation arrives as CancelledError; a CANCELLED status is the server
                # cancelling the stream as it shuts down.
                raise Unavailable(f"the broker cut the watch of request {request_id!r}: {exc.details()}") from None
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    def _exchanged(self) -> bool:
        return self.exchange is not None and self.exchange.supported is not False

    async def _watch_exchanged(self, request: bpb.WatchTransferRequest,
                               deadline: float) -> AsyncIterator[TransferStatus]:
        """A watch on the Exchange stream; made again once on a new stream if this one breaks, so
        that the caller sees how the broker ended the request the broken stream carried."""
        assert self.exchange is not None
        for attempt in range(2):
            try:
                async with contextlib.aclosing(self.exchange.watch(request, self._remaining(deadline))) as replies:
                    async for reply in replies:  # left early, its close cancels the watch on the broker
                        yield TransferStatus.from_proto(reply)
                return
            except StreamBroken as exc:
                if attempt:
                    raise Unavailable(str(exc)) from None
                log.warning("%s; watching request %s again", exc, request.request_id)

    async def wait(self, engine_id: str, request_id: str, *, timeout: float | None = None) -> TransferStatus:
        """Wait for the request to end: its status when SUCCEEDED, else the typed error of its failure."""
        last: TransferStatus | None = None
        async for status in self.watch(engine_id, request_id, timeout=timeout):
            last = status
        if last is None or not last.state.terminal:
            raise Unknown(f"the watch of request {request_id!r} ended before a terminal state")
        if last.state is TransferState.FAILED:
            raise from_status(last)
        return last

    async def cancel(self, engine_id: str, request_id: str, reason: str = "", *,
                     timeout: float | None = None, offer_wait_s: float = 0.0) -> TransferStatus:
        """Cancel a grant or an outgoing transfer; returns its state after (FAILED, or terminal already).
        With `offer_wait_s`, a sender's broker that does not hold the request yet waits that long (at
        most its offer_wait_s) for the receiver's offer, and cancels it once it lands."""
        reply = await self._unary("CancelTransfer", bpb.CancelTransferRequest(
            engine_id=engine_id, request_id=request_id, reason=reason,
            offer_wait_ms=max(0, round(offer_wait_s * 1000))), self._deadline(timeout, self.timeout))
        return TransferStatus.from_proto(reply.status)

    # -- deadlines, errors, restarts -----------------------------------------------------------
    @staticmethod
    def _deadline(timeout: float | None, default: float) -> float:
        return asyncio.get_running_loop().time() + (default if timeout is None else timeout)

    @staticmethod
    def _remaining(deadline: float) -> float:
        return max(0.0, deadline - asyncio.get_running_loop().time())

    async def _unary(self, method: str, request, deadline: float, *, retry_unavailable: bool = True,
                     wait_for_ready: bool = False):
        """One unary call; after a broker restart (see the module's map) it is retried once."""
        seen = self._epoch
        try:
            return await self._call(method, request, deadline, wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            code = exc.code()
        except Unavailable as exc:  # the Exchange stream broke under the command, or the broker refused it
            error, code = exc, exc.code
        except NotFound as exc:
            error, code = exc, exc.code
        may_be_restart = code is grpc.StatusCode.UNAVAILABLE or (
            code is grpc.StatusCode.NOT_FOUND and bool(self._engines))
        if not (may_be_restart and await self._recover(deadline, since=seen)):
            raise self._explain_lost(error, request)
        if code is grpc.StatusCode.UNAVAILABLE and not retry_unavailable:
            raise error
        try:
            return await self._call(method, request, deadline)
        except grpc.aio.AioRpcError as exc:
            raise self._explain_lost(from_rpc_error(exc), request) from None
        except NotFound as exc:
            raise self._explain_lost(exc, request) from None

    async def _call(self, method: str, request, deadline: float, wait_for_ready: bool = False):
        """The call on the Exchange stream when it carries `method` and the broker offers it, else unary.
        Either way the reply is the unary RPC's response message."""
        if method in EXCHANGED and self._exchanged():
            assert self.exchange is not None
            kind = EXCHANGED[method]
            try:
                reply = await self.exchange.command(kind, request, self._remaining(deadline))
                return getattr(reply, kind)
            except StreamBroken as exc:
                raise Unavailable(str(exc)) from None
            except ExchangeUnsupported:
                log.info("broker %s has no Exchange stream; using its unary RPCs", self.target)
        return await getattr(self._stub, method)(request, timeout=self._remaining(deadline),
                                                 wait_for_ready=wait_for_ready)

    def _explain_lost(self, error: BrokerError, request) -> BrokerError:
        engine_id = getattr(request, "engine_id", "")
        if isinstance(error, NotFound) and engine_id in self._lost:
            return NotFound(f"{error.reason}; engine {engine_id!r} had broker-owned memory, which went with the "
                            "broker's restart: register it again and use the new pool")
        return error

    async def _recover(self, deadline: float, *, since: int | None = None,
                       seen: bpb.GetBrokerInfoResponse | None = None) -> bool:
        """True when the broker lost our engines (a new epoch: a new process; or our session ended)
        and they are registered again."""
        if self._epoch is None:
            return False
        session_before = self._session_id
        async with self._recovery:
            if since is not None and self._epoch != since:
                return True  # another call recovered while this one waited for the lock
            if self._session_id and self._session_id != session_before:
                return True  # another recovery opened a new session meanwhile: `seen` predates it
            if seen is None:
                try:
                    seen = await self._stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(),
                                                          timeout=self._remaining(deadline), wait_for_ready=True)
                except grpc.aio.AioRpcError:
                    return False  # still gone within the deadline: the caller sees the original error
            if seen.epoch == self._epoch:
                open_sessions = {s.session_id for s in seen.sessions}
                if not (self._use_session and self._engines and self._session_id not in open_sessions):
                    return False
                log.warning("broker %s ended this client's session; registering %d engine(s) again",
                            self.target, len(self._engines))
            else:
                log.warning("broker %s restarted (epoch %d -> %d); registering %d engine(s) again",
                            self.target, self._epoch, seen.epoch, len(self._engines))
            await self._end_session()  # whatever the client still holds of the old session
            await self._register_again(deadline, {e.engine_id for e in seen.engines})
            if seen.epoch != self._epoch:
                self.restarts_seen += 1  # counted once: a failed registration is retried under the same epoch
            self._epoch = seen.epoch  # only now: a call that sees the new epoch first waits for the lock
            return True

    async def _register_again(self, deadline: float, present: set[str]) -> None:
        failures: list[BrokerError] = []
        for engine_id, request in list(self._engines.items()):
            if engine_id in present:
                continue
            if request.memory_ownership == bpb.MEMORY_OWNERSHIP_BROKER:
                del self._engines[engine_id]
                self._lost.add(engine_id)
                log.error("engine %s had broker-owned memory, which went with the broker's restart; the server "
                          "must register it again and use the new pool", engine_id)
                continue
            try:
                request.session_id = await self._session(deadline)
                await self._stub.RegisterEngine(request, timeout=self._remaining(deadline))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.ALREADY_EXISTS:
                    failures.append(from_rpc_error(exc))
                    log.error("could not register engine %s again: %s", engine_id, failures[-1])
            except BrokerError as exc:
                failures.append(exc)
                log.error("could not register engine %s again: %s", engine_id, exc)
        if failures:
            raise failures[0]

    # -- the session ------------------------------------------------------------------------------
    async def _session(self, deadline: float) -> str:
        """The id of an open session, opened now if none is; empty when sessions are off."""
        if not self._use_session:
            return ""
        async with self._session_lock:
            if self._session_id:
                return self._session_id
            call = self._stub.OpenSession(bpb.OpenSessionRequest(holder=self.holder))
            try:
                first = await asyncio.wait_for(call.read(), self._remaining(deadline))
            except TimeoutError:
                call.cancel()
                raise DeadlineExceeded(f"no session opened on {self.target} before the deadline") from None
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise Unavailable(f"the broker at {self.target} ended the session as it opened it (shutting down)")
            self._session_call, self._session_id = call, first.session_id
            self._session_task = asyncio.create_task(self._hold(call, first.session_id),
                                                     name=f"kvbroker session {first.session_id}")
            return self._session_id

    async def _hold(self, call: grpc.aio.UnaryStreamCall, session_id: str) -> None:
        """Read the session's stream until it ends; then the session is gone, and so are its engines."""
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            reason = "the broker ended it"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        if self._session_id == session_id:
            self._session_id, self._session_call = "", None
            log.warning("session %s with %s ended (%s); the broker released its engines", session_id,
                        self.target, reason)
            if self._engines and (self._rejoin is None or self._rejoin.done()):
                self._rejoin = asyncio.get_running_loop().create_task(self._rejoin_now(),
                                                                      name=f"kvbroker rejoin {self.target}")

    async def _rejoin_now(self) -> None:
        """The session broke under us (the broker restarted, or the stream dropped): register the engines
        again as soon as the broker answers, within REJOIN_WINDOW_S, rather than at this process's next
        call: a peer broker's offer for one of them may come first, and would find no engine. Calls
        that miss an engine still recover it themselves (`_recover`); the lock makes it happen once."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + REJOIN_WINDOW_S, 0.05
        while loop.time() < deadline:
            try:
                if await self._recover(deadline) or self._session_id:
                    return  # registered again, by us or by a call
            except BrokerError as exc:  # e.g. the old broker, still draining, refused the session
                log.info("registering engines again on %s: %s; retrying", self.target, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        log.warning("broker %s did not take this client's engines back within %.0fs; the next call will",
                    self.target, REJOIN_WINDOW_S)

    async def _end_session(self) -> None:
        call, task = self._session_call, self._session_task
        self._session_id, self._session_call, self._session_task = "", None, None
        if call is not None:
            call.cancel()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
