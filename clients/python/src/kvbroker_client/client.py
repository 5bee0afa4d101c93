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

or, on decode, the grant and its end as one command (what the adapters use):

    async for status in client.expect_and_watch(engine_id, request_id, {...}, sender_address=...):
        ...                                                                    # PENDING, then the end

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

BrokerClient is the façade; its jobs are modules of their own: requests.py builds and checks each
request, calls.py sends it (Exchange stream or unary, retried after a restart), recovery.py holds
what was registered and brings it back, session.py the session and the deadlines.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence

import grpc

from kvbroker_client import requests
from kvbroker_client.calls import Calls
from kvbroker_client.errors import DeadlineExceeded, NotFound, Unavailable, Unknown, from_status
from kvbroker_client.exchange import Exchange
from kvbroker_client.model import (
    BrokerInfo,
    Component,
    ComponentSpec,
    EngineInfo,
    Topology,
    TransferState,
    TransferStatus,
)
from kvbroker_client.recovery import REJOIN_WINDOW_S, Registrations
from kvbroker_client.requests import ComponentLike, PageIds
from kvbroker_client.session import Session, deadline, remaining
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb

__all__ = ["BrokerClient", "CHANNEL_OPTIONS", "DEFAULT_TIMEOUT_S", "DEFAULT_TRANSFER_TIMEOUT_S", "REJOIN_WINDOW_S"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_TRANSFER_TIMEOUT_S = 120.0
# A sidecar on loopback or a Unix socket comes back within seconds: probe it often, not with
# gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


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
        self.holder = holder or f"{socket.gethostname()} pid {os.getpid()}"
        self._session = Session(self._stub, target, self.holder, enabled=session,
                                on_lost=lambda: self._registrations.session_lost())
        self._registrations = Registrations(self._stub, target, self._session)
        self._calls = Calls(self._stub, self.exchange, target, self._registrations)

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
        await self._registrations.close()
        await self._session.end()
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
        return self._registrations.epoch

    @property
    def broker_id(self) -> str:
        """The broker's id as last seen (an `info()`, or a restart the client recovered from); empty before."""
        return self._registrations.broker_id

    @property
    def peer_address(self) -> str:
        """The broker's peer address as last seen, like `broker_id`."""
        return self._registrations.peer_address

    @property
    def restarts_seen(self) -> int:
        """Broker restarts this client saw and registered its engines again after."""
        return self._registrations.restarts_seen

    @property
    def registered_engines(self) -> tuple[str, ...]:
        return tuple(self._registrations.engines)

    @property
    def session_id(self) -> str:
        """The open session holding this client's engines; empty when none is open."""
        return self._session.id

    @property
    def lost_engines(self) -> tuple[str, ...]:
        """Broker-owned engines a broker restart released; register them again to get a new pool."""
        return tuple(sorted(self._registrations.lost))

    async def _unary(self, method: str, request, at: float, **options):
        return await self._calls.unary(method, request, at, **options)

    async def info(self, *, timeout: float | None = None, wait_for_ready: bool = False) -> BrokerInfo:
        """The broker's identity, engines, peers and counters. Re-registers engines after a restart."""
        at = deadline(timeout, self.timeout)
        reply = await self._unary("GetBrokerInfo", bpb.GetBrokerInfoRequest(), at, wait_for_ready=wait_for_ready)
        if self._registrations.epoch is None:
            self._registrations.epoch = reply.epoch
        elif reply.epoch != self._registrations.epoch:
            await self._registrations.recover(at, seen=reply)
            reply = await self._unary("GetBrokerInfo", bpb.GetBrokerInfoRequest(), at)
        if reply.epoch == self._registrations.epoch:
            self._registrations.saw(reply)
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
        at = deadline(timeout, self.timeout)
        request = requests.register_request(engine_id, topology, components, memory_ownership, allocation_device)
        if self._registrations.epoch is None:  # a restart is told from the epoch the engine was registered under
            await self.info(timeout=remaining(at))
        request.session_id = await self._session.open(at)
        reply = await self._unary("RegisterEngine", request, at)
        self._registrations.engines[engine_id] = request
        self._registrations.lost.discard(engine_id)
        return EngineInfo.from_proto(reply.engine)

    async def unregister_engine(self, engine_id: str, *, timeout: float | None = None) -> int:
        """Release an engine; returns the number of its requests that were failed by it."""
        registrations = self._registrations
        if engine_id in registrations.lost:
            registrations.lost.discard(engine_id)
            return 0  # the restart that lost its pool released it
        ours = registrations.engines.pop(engine_id, None) is not None
        at, epoch = deadline(timeout, self.timeout), registrations.epoch
        try:
            reply = await self._unary("UnregisterEngine", bpb.UnregisterEngineRequest(engine_id=engine_id), at)
        except NotFound:
            if ours and await registrations.recover(at, since=epoch):
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
        dst_pages, dst_page_ids = requests.grant_pages_of_old(dst_pages, dst_page_ids, pages)
        request = requests.grant_request(engine_id, request_id, dst_pages, dst_page_ids=dst_page_ids,
                                         components=components, src_offsets=src_offsets,
                                         sender_address=sender_address, sender_engine_id=sender_engine_id,
                                         expiry_s=expiry_s)
        reply = await self._unary("ExpectTransfer", request, deadline(timeout, self.timeout))
        return TransferStatus.from_proto(reply.status)

    async def expect_and_watch(self, engine_id: str, request_id: str, dst_pages: Mapping[ComponentLike, PageIds], *,
                               sender_address: str, sender_engine_id: str = "", expiry_s: float | None = None,
                               src_offsets: Mapping[ComponentLike, int] | None = None, timeout: float | None = None,
                               watch_timeout: float | None = None) -> AsyncGenerator[TransferStatus, None]:
        """The offered flow's grant and its end as one command: yields the grant's status (as
        `expect_transfer` returns it, within `timeout`), then the request's terminal status (within
        `watch_timeout`, transfer_timeout by default; past it DeadlineExceeded, and the request goes
        on: watch it again). SUCCEEDED carries the sender's aux. On the Exchange stream it is one
        command (two replies); elsewhere `expect_transfer` and a terminal-only `watch`."""
        request = requests.grant_request(engine_id, request_id, dst_pages, dst_page_ids=(), components=(),
                                         src_offsets=src_offsets, sender_address=sender_address,
                                         sender_engine_id=sender_engine_id, expiry_s=expiry_s)
        async for status in self._calls.expect_watch(request, deadline(timeout, self.timeout),
                                                     deadline(watch_timeout, self.transfer_timeout)):
            yield status

    async def transfer_part(self, engine_id: str, request_id: str,
                            src_pages: Mapping[ComponentLike, PageIds] | None = None, *, last: bool | None = None,
                            dst_offsets: Mapping[ComponentLike, int] | None = None, aux: bytes = b"",
                            receiver_broker_id: str = "", timeout: float | None = None,
                            pages: Mapping[ComponentLike, PageIds] | None = None,
                            end_watches: bool | None = None) -> TransferStatus:
        """Sender side of the offered flow: write one part of a grant the receiver offered to this
        broker; returns once the receiver was told (after the last part: the request's final state).

        `src_pages` maps each component to its source page ids; they land on the grant's list of
        that component from entry `dst_offsets[component]` (0 when not given). `last` says whether
        this is the last part (`last=False` for every chunk that more follow); the last part may
        carry `aux` bytes for the receiver. If the offer has not reached this broker yet, the broker
        waits for it (bounded by its offer_wait_s). `receiver_broker_id` names the receiving broker
        (its broker id) whose offer the part is for; empty takes the one offer for the request id,
        refused while several receivers offered it. On the Exchange stream the last part's SUCCEEDED
        reply is also the last status of this client's watches of the request (the broker sends
        them none of their own: one message for the request's end); `end_watches=False` leaves
        them their own.

        Deprecated, kept for a release: `pages=` (now `src_pages=`), and leaving out `last` (it
        meant last=True); each warns (DeprecationWarning).
        """
        src_pages, last = requests.part_pages_of_old(src_pages, last, pages)
        request = requests.part_request(engine_id, request_id, src_pages, last=last, dst_offsets=dst_offsets,
                                        aux=aux, receiver_broker_id=receiver_broker_id,
                                        end_watches=last if end_watches is None else end_watches)
        reply = await self._unary("Transfer", request, deadline(timeout, self.transfer_timeout),
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
        request = requests.claimed_request(engine_id, request_id, peer_address, remote_engine_id, src_page_ids,
                                           dst_page_ids, components)
        reply = await self._unary("Transfer", request, deadline(timeout, self.transfer_timeout),
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
        request = requests.watch_request(engine_id, request_id, states_only=states_only,
                                         terminal_only=terminal_only, offer_wait_s=offer_wait_s)
        async for status in self._calls.watch(request, deadline(timeout, self.transfer_timeout)):
            yield status

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
        request = requests.cancel_request(engine_id, request_id, reason, offer_wait_s)
        reply = await self._unary("CancelTransfer", request, deadline(timeout, self.timeout))
        return TransferStatus.from_proto(reply.status)
