"""kvbroker as an SGLang 0.5.23 transfer backend: the classes `get_kv_class(TransferBackend.KVBROKER, ...)` returns.

SGLang's scheduler calls these synchronously, from its event loop; each KV manager owns a
`LoopThread` on which its `BrokerClient` (a session to the broker in its pod) and every request's
task run, so no call here waits on the network except the bounded ones at startup and shutdown.

Discovery is SGLang's own: prefill ranks PUT /route on the bootstrap server, now with their broker's
peer address and engine id; decode ranks GET /route, push a registration frame and, per request,
a metadata frame over SGLang's ZMQ control socket (`wire`).

    decode  KvbrokerKVReceiver.send_metadata -> ExpectTransfer(pages per component, offered to the
            prefill broker), and meanwhile the metadata frame -> watch the grant -> aux rows written
            -> Success
    prefill metadata frame (WaitingForInput) -> watch the offered sender record, waiting at the
            broker for decode's offer if it has not landed yet
            KvbrokerKVSender.send per chunk -> one Transfer part; the last carries the states and aux
    both    poll() is SGLang's KVPoll from the broker's states; a room that fails is cancelled on the
            broker, and poll() holds it (Transferring) until the broker says no write into its
            pages runs, so SGLang frees nothing a transfer still touches; that answer is also
            decode's abort ack (SGLang's deferred release). The broker's answer is the failure:
            its code and reason, whichever side or broker ended the request

    both    a request whose whole prompt decode holds has no page to grant: kvbroker_sglang.aux_only
    prefill a room that ended before decode's offer reached this broker is remembered (`_ended_early`):
            the late offer is cancelled at once, so decode fails then, not at SGLang's waiting timeout

    KvbrokerKVManager, KvbrokerKVSender, KvbrokerKVReceiver, KvbrokerKVBootstrapServer
    Settings (environment: KVBROKER_ADDRESS, KVBROKER_ENGINE_PREFIX, ...)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import zmq
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_parallel

from kvbroker_client import BrokerClient, BrokerError, Component, NotFound, TransferState, TransferStatus
from kvbroker_client.errors import DeadlineExceeded
from kvbroker_sglang.aux import AuxError, decode_aux, encode_aux, write_aux
from kvbroker_sglang.aux_only import AuxOnlyRequests
from kvbroker_sglang.layout import engine_components, engine_topology, state_component_of
from kvbroker_sglang.loop import LoopThread
from kvbroker_sglang.memory import MemoryExporter, NotExportable
from kvbroker_sglang.wire import METADATA_TAG, OUTCOME_TAG, REGISTER_TAG, Metadata, Outcome, Registration, WireError

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "unix:/run/kvbroker/kvbroker.sock"
# Prefill: how many rooms that ended before decode's frame came are remembered. Rooms are random
# 63-bit ids, so only a frame later than this many such endings finds none (and waits out its expiry).
ENDED_EARLY_ROOMS = 4096


@dataclass(frozen=True)
class Settings:
    """What a KV manager reads from its environment, once."""

    address: str = DEFAULT_ADDRESS  # KVBROKER_ADDRESS: the broker in this pod (unix:PATH or host:port)
    engine_prefix: str = ""  # KVBROKER_ENGINE_PREFIX: engine ids are "<prefix>/<mode>/dp<d>-tp<t>-pp<p>"
    connect_timeout_s: float = 30.0  # KVBROKER_CONNECT_TIMEOUT_S: startup: connect and register
    call_timeout_s: float = 30.0  # KVBROKER_CALL_TIMEOUT_S: one offer, part or cancel
    grant_expiry_s: float | None = None  # KVBROKER_GRANT_EXPIRY_S: unset: SGLang's own wait (waiting_timeout)
    watch_timeout_s: float = 600.0  # one WatchTransfer stream; watched again while the request lives

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        def number(name: str, default):
            value = env.get(name, "")
            return float(value) if value else default

        prefix = env.get("KVBROKER_ENGINE_PREFIX") or f"{socket.gethostname()}-{os.getpid()}"
        return cls(address=env.get("KVBROKER_ADDRESS") or DEFAULT_ADDRESS,
                   engine_prefix=re.sub(r"[^A-Za-z0-9._:-]", "-", prefix)[:64],
                   connect_timeout_s=number("KVBROKER_CONNECT_TIMEOUT_S", cls.connect_timeout_s),
                   call_timeout_s=number("KVBROKER_CALL_TIMEOUT_S", cls.call_timeout_s),
                   grant_expiry_s=number("KVBROKER_GRANT_EXPIRY_S", None))


class KvbrokerTransferError(KVTransferError):
    """SGLang's KVTransferError with the broker's status code (`code`, a grpc.StatusCode) when it has one."""

    def __init__(self, bootstrap_room: int, failure_reason: str, *, code=None, is_from_another_rank: bool = False):
        super().__init__(bootstrap_room, failure_reason, is_from_another_rank)
        self.code = code


@dataclass
class _Part:
    pages: dict[Component, np.ndarray]
    dst_offset: int
    last: bool
    aux: bytes
    wait_event: object | None


@dataclass
class _Room:
    """What the manager tracks of one request beyond SGLang's request_status."""

    offered: bool = False  # the broker may hold a record of it (decode: a grant asked; prefill: an offer)
    aux_index: int | None = None  # decode: where this request's aux rows go
    task: object | None = None  # the follower (a concurrent Future on the loop)
    cancel: object | None = None  # the cancel in flight, or done
    lock: asyncio.Lock | None = None  # prefill: parts go to the broker in SGLang's order
    code: object | None = None  # the broker's code of the first failure
    offering: asyncio.Future | None = None  # decode: the ExpectTransfer call, on the loop
    cleared: bool = False  # SGLang cleared the room while its cancel ran: forget it once that answers
    has_sender: bool = False  # prefill: SGLang made the room's KVSender (decode's frame may come first)
    parts_sent: int = 0  # prefill: parts handed to the loop; only they read the room's pages
    final: TransferStatus | None = None  # prefill: the broker's SUCCEEDED status (bytes moved)
    succeeded_at: float | None = None  # prefill: when it arrived (time.perf_counter)
    aux_only: bool = False  # decode holds the whole prompt: no grant, the aux row comes as an Outcome frame
    endpoint: str = ""  # prefill, aux-only: decode's control address, where the Outcome goes
    told: bool = False  # prefill, aux-only: the Outcome went


def _failure(error: BrokerError | TransferStatus) -> tuple[str, object]:
    """(reason, code) of a broker error or a FAILED status, as SGLang's failure record says it."""
    code = error.code
    return f"kvbroker {getattr(code, 'name', code)}: {error.reason}", code


class KvbrokerKVManager(AuxOnlyRequests, CommonKVManager):
    """One SGLang rank's engine on its broker, and the requests it moves (see the module's map)."""

    # Deferred decode KV release: the broker's cancel answering stands for the prefill's drain ACK.
    supports_deferred_decode_kv_release = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend=False):
        self.settings = Settings.from_env()
        self.loop: LoopThread | None = None
        self.client: BrokerClient | None = None
        self.engine_id = ""
        self.broker_address = ""
        self.broker_id = ""  # ours, told to prefill in each Metadata frame: its parts name this receiver
        self._rooms: dict[int, _Room] = {}
        self._rooms_lock = threading.RLock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.peers_changed = threading.Condition()  # prefill: notified when a decode rank registers
        self._ended_early: OrderedDict[int, str] = OrderedDict()  # prefill: room -> why, no frame came before
        try:
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            self._open()  # prefill opened it already, to PUT its broker on /route
            # prefill: decode's frames; decode: prefill's Outcome frames (aux-only requests)
            self._start_thread(self._control_loop, "kvbroker control")
            if disaggregation_mode == DisaggregationMode.DECODE:
                self._threads.append(self._start_heartbeat_checker_thread())
        except BaseException:
            self.close()
            raise

    # -- startup and shutdown ------------------------------------------------------------------
    def _open(self) -> None:
        if self.client is not None:
            return
        mode = self.disaggregation_mode.value
        self.engine_id = (f"{self.settings.engine_prefix}/{mode}/dp{self.system_dp_rank}-tp{self.kv_args.engine_rank}"
                          f"-pp{self.pp_rank}")
        exporter = MemoryExporter()
        self._check_aux_on_host(exporter)
        components = engine_components(self.kv_args, exporter.refs, is_mla=bool(self.is_mla_backend))
        parallel = get_parallel()
        topology = engine_topology(self.kv_args, components, tp_size=getattr(parallel, "tp_size", self.attn_tp_size),
                                   tp_rank=self.kv_args.engine_rank, attn_tp_size=self.attn_tp_size,
                                   attn_tp_rank=self.attn_tp_rank, pp_size=self.pp_size, pp_rank=self.pp_rank,
                                   dp_rank=self.system_dp_rank)
        self.loop = LoopThread(f"kvbroker {self.engine_id}")
        timeout = self.settings.connect_timeout_s

        async def connect() -> tuple[BrokerClient, tuple[str, str]]:
            client = await BrokerClient.connect(self.settings.address, timeout=timeout,
                                                holder=f"sglang {mode} {self.engine_id} pid {os.getpid()}")
            try:
                await client.register_engine(self.engine_id, topology, components)
                info = await client.info()
                return client, (info.peer_address, info.broker_id)
            except BaseException:
                await client.close()
                raise

        self.client, (self.broker_address, self.broker_id) = self.loop.run(connect(), timeout=timeout + 5)
        log.info("kvbroker: engine %s registered with the broker at %s (peer address %s): %s", self.engine_id,
                 self.settings.address, self.broker_address,
                 ", ".join(f"{c.component.name} {len(c.layer_buffers)} buffers" for c in components))

    @property
    def grant_expiry_s(self) -> float:
        """Decode's grants live as long as SGLang waits for their transfer (SGLANG_DISAGGREGATION_WAITING_TIMEOUT,
        300 s), not the broker's shorter default: a request may wait in prefill's queue that long."""
        if self.settings.grant_expiry_s is not None:
            return self.settings.grant_expiry_s
        return float(self.waiting_timeout)

    def _check_aux_on_host(self, exporter: MemoryExporter) -> None:
        driver = exporter._cuda
        for i, ptr in enumerate(self.kv_args.aux_data_ptrs):
            if driver is not None and driver.allocation(int(ptr)) is not None:
                raise NotExportable(f"aux_data_ptrs[{i}] is GPU memory: kvbroker moves SGLang's metadata rows as "
                                    "bytes read on the host; unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL")

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Stop the threads, end every task, close the session (the broker then releases the engine)."""
        self._stopping.set()
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        for thread in self._threads:
            thread.join(5)
        if self.loop is not None:
            client = self.client
            self.loop.close(before_stop=client.close() if client is not None else None)
        # The PUSH sockets (and their monitors) SGLang's _connect cached: aux-only outcomes to decode;
        # an open one would block the ZMQ context's term() when the manager is collected.
        with getattr(self, "_socket_lock", threading.Lock()):
            cached = [*getattr(self, "_socket_cache", {}).values(), *getattr(self, "_monitor_cache", {}).values()]
            for table in ("_socket_cache", "_monitor_cache"):
                getattr(self, table, {}).clear()
        for socket_ in [*cached, getattr(self, "server_socket", None)]:
            if socket_ is not None:
                socket_.close(linger=0)

    # -- bootstrap (prefill): the /route row carries the broker ---------------------------------
    def _register_topology_row(self, url: str, payload: dict) -> None:
        self._open()
        payload = {**payload, "kvbroker": {"broker_address": self.broker_address, "engine_id": self.engine_id}}
        super()._register_topology_row(url, payload)

    # -- frames decode pushes to prefill -------------------------------------------------------
    def build_receiver_registration_message(self) -> list[bytes]:
        return Registration(f"{self.local_ip}:{self.rank_port}", self.broker_address, self.engine_id,
                            self.attn_tp_size, self.kv_args.engine_rank,
                            tuple(int(x) for x in self.kv_args.aux_item_lens)).to_frames()

    def build_receiver_metadata_message(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index,
                                        state_indices, decode_prefix_len, is_dummy, device_kv_indices=None,
                                        aux_only: bool = False):
        return Metadata(int(bootstrap_room), f"{self.local_ip}:{self.rank_port}", self.engine_id,
                        int(required_dst_info_num), int(decode_prefix_len or 0), bool(is_dummy),
                        self.broker_id, aux_only).to_frames()

    # -- request state, shared by the scheduler, the control thread and the loop ----------------
    def room(self, room: int) -> _Room:
        with self._rooms_lock:
            return self._rooms.setdefault(room, _Room())

    def update_status(self, bootstrap_room: int, status: KVPoll):
        with self._rooms_lock:
            super().update_status(bootstrap_room, status)
        if status == KVPoll.Failed:
            reason = self.failure_records.get(bootstrap_room, "request failed")
            self.cancel_room(bootstrap_room, reason)
            if self.disaggregation_mode == DisaggregationMode.PREFILL:
                self.tell_decode(bootstrap_room, Outcome(bootstrap_room, failure=reason))

    def fail(self, room: int, reason: str, code=None) -> None:
        """Record the first root cause of a room's failure (and the broker's code) and mark it Failed."""
        with self._rooms_lock:
            if room not in self.request_status or self.request_status[room] == KVPoll.Success:
                return
            with self.failure_lock:
                self.failure_records.setdefault(room, reason)
            state = self._rooms.setdefault(room, _Room())
            if state.code is None:
                state.code = code
        self.update_status(room, KVPoll.Failed)

    def holding(self, room: int) -> bool:
        """Whether SGLang must not free the room's pages yet: its cancel has not answered, and a write
        may still touch them: on decode, anything once the grant is offered; on prefill, only parts,
        which read its pages. A prefill room no part left for is still in SGLang's bootstrap queue,
        which takes no Transferring (pop_bootstrapped raises on it): see clients/README.md's table."""
        state = self._rooms.get(room)
        if state is None or state.cancel is None or state.cancel.done():
            return False
        return self.disaggregation_mode == DisaggregationMode.DECODE or state.parts_sent > 0

    def forget(self, room: int) -> None:
        """SGLang cleared the room: drop what is kept of it, now or, while its cancel runs, once it answers."""
        with self._rooms_lock:
            state = self._rooms.get(room)
            if state is None:
                return
            if state.cancel is not None and not state.cancel.done():
                state.cleared = True
                return
            del self._rooms[room]
        if state.task is not None:
            state.task.cancel()

    def failure_code(self, room: int):
        state = self._rooms.get(room)
        return None if state is None else state.code

    def cancel_room(self, room: int, reason: str, *, unknown_reason: str | None = None) -> None:
        """Cancel the room on the broker, once; the broker answers when no write into it runs.

        Only rooms that may have a record there (`offered`) are cancelled. The broker's answer is
        the room's failure: its code, and its reason unless an earlier cause was recorded. A broker
        with no record of the room fails it with `unknown_reason` when given.
        """
        with self._rooms_lock:
            state = self._rooms.get(room)
            if state is None or not state.offered or state.cancel is not None:
                return
            if self.loop is None or self.client is None:
                return
            follower = state.task
            offer_wait_s = self._offer_wait_s(room)

            async def cancel() -> None:
                if follower is not None:
                    follower.cancel()
                if state.offering is not None:  # decode: the grant may be in the making
                    await asyncio.wait([state.offering], timeout=self.settings.call_timeout_s)
                try:
                    status = await self.client.cancel(self.engine_id, str(room), reason[:512],
                                                      timeout=self.settings.call_timeout_s, offer_wait_s=offer_wait_s)
                except NotFound:
                    if unknown_reason is not None:  # never offered here, or gone: nothing writes into it
                        self.fail(room, unknown_reason)
                    return
                except BrokerError as exc:
                    log.error("kvbroker: cancelling request %s on the broker failed (%s); its pages are released "
                              "anyway", room, exc)
                    self.fail(room, *_failure(exc))
                    return
                if status.state is TransferState.FAILED:
                    self.fail(room, *_failure(status))

            state.cancel = self.loop.spawn(cancel(), name=f"cancel {room}")
            state.cancel.add_done_callback(lambda _: self._cancelled(room))

    def _offer_wait_s(self, room: int) -> float:
        """Prefill: how long a cancel waits at the broker for decode's offer. Decode sends its
        metadata frame while the offer travels, so once the frame came the offer may not have landed
        yet, and a cancel that found nothing would leave it to its expiry, decode waiting on it."""
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return 0.0
        infos = self.transfer_infos.get(room, {})
        return self.settings.call_timeout_s if any(not i.is_dummy and not i.aux_only for i in infos.values()) else 0.0

    def cancel_unfinished(self, room: int) -> None:
        """SGLang clears a room it no longer follows: one that has not ended must not stay writable
        on the broker until its grant expires."""
        if self.request_status.get(room) not in (None, KVPoll.Success, KVPoll.Failed):
            self.cancel_room(room, "SGLang cleared the request before its transfer ended")

    def _cancelled(self, room: int) -> None:
        state = self._rooms.get(room)
        if state is not None and state.cleared:
            self.forget(room)
        else:
            self._drop_if_unclaimed(room)

    def when_quiesced(self, room: int, fn) -> None:
        """Call `fn()` once nothing can write into the room's pages: now, or when its cancel answers."""
        state = self._rooms.get(room)
        cancel = None if state is None else state.cancel
        if cancel is None:
            fn()
        else:
            cancel.add_done_callback(lambda _: fn())

    # -- prefill: the control socket -------------------------------------------------------------
    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):  # wakes to see _stopping; frames are handled as they come
                continue
            frames = self.server_socket.recv_multipart()
            try:
                self._on_control(frames)
            except (WireError, ValueError) as exc:
                log.warning("kvbroker: dropping a control frame: %s", exc)

    def _on_control(self, frames: list[bytes]) -> None:
        tag = frames[0] if frames else b""
        if tag == REGISTER_TAG:
            registration = Registration.from_frames(frames)
            with self.peers_changed:
                self.decode_kv_args_table[registration.endpoint] = registration
                self.peers_changed.notify_all()
            self.check_peer_aux_buffer_count(registration.endpoint, len(registration.aux_item_lens))
        elif tag == METADATA_TAG:
            self._on_metadata(Metadata.from_frames(frames))
        elif tag == OUTCOME_TAG:
            self.on_outcome(Outcome.from_frames(frames))
        elif tag == ABORT_TAG:
            notification = AbortNotification.from_zmq(frames)
            if notification is not None:
                self._decode_aborted(notification.room)
        else:
            raise WireError(f"unknown control frame {tag[:32]!r}")

    def _decode_aborted(self, room: int) -> None:
        """SGLang's abort frame from decode: the room fails with what the broker says of it.

        Decode's cancel revokes its grant at this broker too; whichever comes first, cancelling
        the room here answers with its failure (CANCELLED and the reason) once no part writes into it.
        """
        with self._rooms_lock:
            if self.request_status.get(room) in (None, KVPoll.Success):
                return  # gone already, or done: as upstream, an abort after Success changes nothing
            self.room(room).offered = True  # the offer may sit on this broker even before decode's metadata
        self.cancel_room(room, "the decode side aborted the request",
                         unknown_reason="the decode side aborted the request (this broker held no record of it)")

    def _on_metadata(self, meta: Metadata) -> None:
        room = meta.room
        with self._rooms_lock:
            ended = self._ended_early.pop(room, None)
            if ended is None and self.request_status.get(room) == KVPoll.Failed:
                ended = self.failure_records.get(room, "the prefill side failed the request")
        if ended is not None:
            self._refuse_late_offer(room, meta, ended)
            return
        with self._rooms_lock:
            # Decode's frame may come before SGLang makes the room's KVSender: the router posts the
            # request to both servers at once. SGLang lets the frame open the room (update_status
            # creates it only in an opening state); the sender, when it comes, joins it.
            self.update_status(room, KVPoll.Bootstrapping)
            infos = self.transfer_infos.setdefault(room, {})
            infos[meta.endpoint] = meta
            if len(infos) < meta.required_dst_info_num:
                return
            self.req_to_decode_prefix_len[room] = meta.decode_prefix_len
            real = [info for info in infos.values() if not info.is_dummy]
        if not real:
            self.update_status(room, KVPoll.WaitingForInput)
        elif real[0].aux_only and len(real) == 1:
            state = self.room(room)  # no offer to watch: the last chunk answers decode with an Outcome
            state.aux_only, state.endpoint = True, real[0].endpoint
            self.update_status(room, KVPoll.WaitingForInput)
        elif len(real) > 1:
            self.fail(room, f"kvbroker moves a request from one prefill rank into one decode rank; {len(real)} "
                            "decode ranks asked this rank for it (decode attention TP above prefill's)")
        else:
            # Decode pushes the frame while its offer is on the way to this broker: WaitingForInput
            # now, not after the offer landed (time to first token). The watch waits for the offer
            # (offer_wait_s) and follows it from then; parts wait for it too. One that never comes,
            # or is revoked meanwhile, fails the room.
            self.update_status(room, KVPoll.WaitingForInput)
            state = self.room(room)
            state.task = self.loop.spawn(self._watch_offer(room), name=f"watch {room}")

    def _refuse_late_offer(self, room: int, meta: Metadata, reason: str) -> None:
        """Decode's frame for a room this rank already ended: its offer came after the room's cancel (which
        found nothing to cancel then), so it is cancelled now and decode's grant fails at once."""
        log.info("kvbroker: request %s ended here before decode's offer came (%s); cancelling the offer", room,
                 reason)
        if meta.aux_only:
            with self._rooms_lock:
                state = self.room(room)
                state.aux_only, state.endpoint = True, meta.endpoint
            self.tell_decode(room, Outcome(room, failure=reason))
            with self._rooms_lock:
                if not state.has_sender:
                    self._rooms.pop(room, None)
            return
        if self.loop is None or self.client is None:
            return

        async def cancel() -> None:
            try:  # the offer may still be on its way: decode sent this frame meanwhile
                await self.client.cancel(self.engine_id, str(room), reason[:512], timeout=self.settings.call_timeout_s,
                                         offer_wait_s=self.settings.call_timeout_s)
            except BrokerError as exc:  # NOT_FOUND too: decode withdrew it meanwhile
                log.info("kvbroker: cancelling the late offer of request %s: %s", room, exc)

        self.loop.spawn(cancel(), name=f"refuse {room}")

    def ended_before_decode(self, room: int) -> None:
        """Prefill: SGLang clears a room that did not succeed; if decode's frame never came, its offer may
        still come: remember why the room ended."""
        with self._rooms_lock:
            if room in self.transfer_infos or self.request_status.get(room) == KVPoll.Success:
                return
            with self.failure_lock:
                reason = self.failure_records.get(room, "the prefill side ended the request")
            self._ended_early[room] = reason
            while len(self._ended_early) > ENDED_EARLY_ROOMS:
                self._ended_early.popitem(last=False)

    async def _watch_offer(self, room: int) -> None:
        await self._follow(room, sender=True)
        self._drop_if_unclaimed(room)

    def _drop_if_unclaimed(self, room: int) -> None:
        """A room decode's frame opened that ended (its offer failed, its cancel answered) before SGLang
        made its sender: no sender will clear it, so it is dropped here."""
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return
        with self._rooms_lock:
            state = self._rooms.get(room)
            if (state is None or state.has_sender or self.request_status.get(room) not in (KVPoll.Failed, None)
                    or (state.cancel is not None and not state.cancel.done())):
                return
            for table in (self.request_status, self.transfer_infos, self.req_to_decode_prefix_len):
                table.pop(room, None)
            with self.failure_lock:
                reason = self.failure_records.pop(room, "")
            del self._rooms[room]
        log.warning("kvbroker: request %s ended before this prefill server made its sender: %s", room, reason)

    def claim(self, room: int) -> None:
        """SGLang made the room's KVSender: the room is SGLang's to clear from now on."""
        with self._rooms_lock:
            self.room(room).has_sender = True

    # -- prefill: parts ----------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices=None, num_kv_tokens=None, *,
                             wait_event=None, indices_event=None, trace_ctx=None) -> None:
        """One chunk of a request (CommonKVSender.send): a Transfer part, in order, on the loop."""
        room = bootstrap_room
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return
        infos = self.transfer_infos.get(room)
        if not infos:
            return  # decode never asked this rank (SGLang skips such rooms too)
        if all(info.is_dummy for info in infos.values()):
            if is_last_chunk:
                self.update_status(room, KVPoll.Success)
            return
        if self.room(room).aux_only:
            self._send_aux_only(room, kv_indices, is_last_chunk, aux_index, state_indices)
            return
        pages: dict[Component, np.ndarray] = {}
        if len(kv_indices):
            pages[Component.MAIN_KV] = np.asarray(kv_indices, dtype=np.int64).copy()
        aux = b""
        if is_last_chunk:
            for i, indices in enumerate(state_indices or ()):
                if indices is not None and len(indices):  # an empty list was not granted either
                    pages[state_component_of(self.kv_args, i)] = np.asarray(indices, dtype=np.int64).reshape(-1)
            if aux_index is not None:
                aux = encode_aux(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens, int(aux_index))
        state = self.room(room)
        state.offered = True
        state.parts_sent += 1
        part = _Part(pages, int(index_slice.start), bool(is_last_chunk), aux, wait_event or indices_event)
        self.loop.spawn(self._send_part(room, state, part), name=f"part {room}@{part.dst_offset}")

    def _send_aux_only(self, room: int, kv_indices, is_last_chunk: bool, aux_index, state_indices) -> None:
        sent = len(kv_indices) + sum(len(x) for x in state_indices or () if x is not None)
        if sent:
            self.fail(room, f"decode holds the whole prompt and granted no page, but prefill sent {sent} page ids "
                            "for it")
        elif is_last_chunk:
            aux = b"" if aux_index is None else encode_aux(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens,
                                                           int(aux_index))
            self.tell_decode(room, Outcome(room, aux=aux))

    async def _send_part(self, room: int, state: _Room, part: _Part) -> None:
        if state.lock is None:
            state.lock = asyncio.Lock()
        async with state.lock:
            if self.request_status.get(room) in (None, KVPoll.Failed) or state.cancel is not None:
                return
            if part.wait_event is not None:  # SGLang's early send: the forward may still write these pages
                await asyncio.to_thread(part.wait_event.synchronize)
            offsets = {Component.MAIN_KV: part.dst_offset} if Component.MAIN_KV in part.pages else {}
            receiver = next((i.broker_id for i in self.transfer_infos.get(room, {}).values() if not i.is_dummy), "")
            try:
                status = await self.client.transfer_part(self.engine_id, str(room), part.pages, dst_offsets=offsets,
                                                         last=part.last, aux=part.aux, receiver_broker_id=receiver,
                                                         timeout=self.settings.call_timeout_s)
            except BrokerError as exc:
                self.fail(room, *_failure(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug must fail the room, not strand it
                log.exception("kvbroker: part of request %s", room)
                self.fail(room, f"kvbroker client error: {exc!r}")
                return
            self._apply(room, status)

    # -- decode: the offer -----------------------------------------------------------------------
    def offer(self, receiver: KvbrokerKVReceiver, target: dict, pages: dict[Component, np.ndarray],
              deliveries: list[tuple[dict, list[bytes]]], aux_index: int | None) -> None:
        """SGLang's thread (send_metadata): the metadata frame goes to prefill from here, as upstream
        sends it, and then the grant's ExpectTransfer starts on the loop, travelling while prefill
        runs its forward (the offer's round trip was on the time to first token). The frame goes
        first: once the loop thread wakes for the offer it holds the GIL, and the frame would wait
        for it. Prefill's watch, parts and cancel wait for the offer at its broker (offer_wait_s);
        an offer that fails fails the room, and SGLang then aborts it at prefill. A frame that
        cannot be sent fails the room before any offer is made (the abort tells the ranks that got
        one)."""
        room = receiver.bootstrap_room
        state = self.room(room)
        state.aux_index = aux_index
        for info, frames in deliveries:
            try:
                self._push(receiver, info, frames)
            except zmq.ZMQError as exc:
                self.fail(room, f"metadata to prefill {info.get('rank_ip')}:{info.get('rank_port')} failed: {exc}")
                return
        state.offered = True
        state.task = self.loop.spawn(self._offer_and_follow(room, target, pages), name=f"offer {room}")

    async def _offer_and_follow(self, room: int, target: dict, pages) -> None:
        state = self.room(room)
        # Shielded: a cancel must not cut the offer short (the broker may have made the grant
        # already); it waits for the call to end, then cancels what the call made.
        state.offering = asyncio.ensure_future(self.client.expect_transfer(
            self.engine_id, str(room), pages, sender_address=target["kvbroker_address"],
            sender_engine_id=target["kvbroker_engine_id"], expiry_s=self.grant_expiry_s,
            timeout=self.settings.call_timeout_s))
        state.offering.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here or below
        try:
            await asyncio.shield(state.offering)
        except BrokerError as exc:
            self.fail(room, *_failure(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug must fail the room, not strand it
            log.exception("kvbroker: offer of request %s", room)
            self.fail(room, f"kvbroker client error: {exc!r}")
            return
        await self._follow(room, sender=False)

    @staticmethod
    def _push(receiver: CommonKVReceiver, info: dict, frames: list[bytes]) -> None:
        sock, lock = receiver._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart(frames)

    # -- both: the broker's view of a request ------------------------------------------------------
    async def _follow(self, room: int, *, sender: bool) -> None:
        """Watch the request on this side's broker until it ends, into SGLang's request_status."""
        while room in self.request_status:
            try:
                # states_only: SGLang's KVPoll follows the state; a message per landed part is not
                # needed. On prefill only the end: its queue takes WaitingForInput and Transferring
                # alike, and each part's reply carries its state, so PENDING and TRANSFERRING would
                # cost prefill and its broker a message each, the latter while the first part is
                # written (decode's Transferring tells that a chunk landed, before the last comes).
                async for status in self.client.watch(self.engine_id, str(room), states_only=True, terminal_only=sender,
                                                      timeout=self.settings.watch_timeout_s,
                                                      offer_wait_s=self.settings.call_timeout_s if sender else 0.0):
                    self._apply(room, status)
                    if status.state.terminal:
                        return
            except DeadlineExceeded:
                continue  # a long wait (prefill queue): watch again
            except NotFound:
                what = "the decode broker's offer for it" if sender else "its grant"
                self.fail(room, f"kvbroker NOT_FOUND: this broker has no record of request {room} ({what} was "
                                "lost, expired or revoked)", None)
                return
            except BrokerError as exc:
                self.fail(room, *_failure(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug must fail the room, not strand it
                log.exception("kvbroker: watch of request %s", room)
                self.fail(room, f"kvbroker client error: {exc!r}")
                return

    def _apply(self, room: int, status: TransferStatus) -> None:
        if status.state is TransferState.PENDING:
            self.update_status(room, KVPoll.WaitingForInput)
        elif status.state is TransferState.TRANSFERRING:
            self.update_status(room, KVPoll.Transferring)
        elif status.state is TransferState.FAILED:
            self.fail(room, *_failure(status))
        elif self.disaggregation_mode == DisaggregationMode.DECODE:
            self._land_aux(room, status)
        else:
            state = self._rooms.get(room)
            if state is not None and state.final is None:
                state.final, state.succeeded_at = status, time.perf_counter()
            self.update_status(room, KVPoll.Success)

    def _land_aux(self, room: int, status: TransferStatus) -> None:
        if self.write_aux(room, status.aux):
            self.update_status(room, KVPoll.Success)

    def write_aux(self, room: int, aux: bytes) -> bool:
        """Decode: prefill's aux rows into this room's metadata slot; False (the room failed) if they do not fit."""
        state = self._rooms.get(room)
        index = None if state is None else state.aux_index
        if index is not None:
            try:
                rows = decode_aux(aux)
                if len(rows) != len(self.kv_args.aux_data_ptrs):
                    log.warning("kvbroker: request %s: prefill sent %d aux rows, this rank has %d buffers; the "
                                "first %d are written", room, len(rows), len(self.kv_args.aux_data_ptrs),
                                min(len(rows), len(self.kv_args.aux_data_ptrs)))
                lens, items = self.kv_args.aux_data_lens, self.kv_args.aux_item_lens
                if any((index + 1) * int(n) > int(total) for n, total in zip(items, lens)):
                    raise AuxError(f"aux index {index} is past this rank's metadata buffers")
                write_aux(rows, self.kv_args.aux_data_ptrs, items, index)
            except AuxError as exc:
                self.fail(room, f"kvbroker aux: {exc}")
                return False
        return True


class KvbrokerKVSender(CommonKVSender):
    """Prefill side of one request: CommonKVSender's lifecycle, parts through the manager."""

    kv_mgr: KvbrokerKVManager

    def __init__(self, mgr: KvbrokerKVManager, bootstrap_addr: str, bootstrap_room: int, *args, **kwargs):
        mgr.claim(bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)

    def poll(self) -> KVPoll:
        if self.kv_mgr.holding(self.bootstrap_room):
            return KVPoll.Transferring
        status = super().poll()
        if status == KVPoll.Success:
            self._record_metric()
        return status

    def _record_metric(self) -> None:
        """What the broker moved (bytes over every component and buffer) and how long it took from
        SGLang's first send() to the broker's SUCCEEDED; kept here, as SGLang clears the room first."""
        state = self.kv_mgr._rooms.get(self.bootstrap_room)
        if state is None or state.final is None or self._transfer_metric.transfer_total_bytes is not None:
            return
        self._transfer_metric.transfer_total_bytes = int(state.final.bytes)
        if self._transfer_start_time is not None and state.succeeded_at is not None:
            self._transfer_metric.transfer_latency_s = max(0.0, state.succeeded_at - self._transfer_start_time)

    def get_transfer_metric(self):
        """prefill.py logs it per request (latency, bytes, speed): the broker's bytes once it succeeded."""
        if self._transfer_metric.transfer_total_bytes is None:
            return super().get_transfer_metric()  # not succeeded: SGLang's own estimate from the page counts
        return self._transfer_metric

    def poll_pp_consensus(self) -> KVPoll:
        if self.kv_mgr.holding(self.bootstrap_room):
            return KVPoll.Transferring
        return super().poll_pp_consensus()

    def abort(self) -> None:
        state = self.kv_mgr.room(self.bootstrap_room)
        state.offered = True  # the decode's offer may sit on our broker: cancelling it tells decode
        super().abort()

    def clear(self) -> None:
        self.kv_mgr.cancel_unfinished(self.bootstrap_room)
        self.kv_mgr.ended_before_decode(self.bootstrap_room)
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def failure_exception(self):
        code = self.kv_mgr.failure_code(self.bootstrap_room)
        try:
            super().failure_exception()
        except KVTransferError as exc:
            raise KvbrokerTransferError(exc.bootstrap_room, exc.failure_reason, code=code,
                                        is_from_another_rank=exc.is_from_another_rank) from None


class KvbrokerKVReceiver(CommonKVReceiver):
    """Decode side of one request: discovery as CommonKVReceiver, then a grant offered to the prefill broker."""

    kv_mgr: KvbrokerKVManager

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, device_kv_indices=None):
        room = self.bootstrap_room
        if self.bootstrap_infos is None:
            self.kv_mgr.fail(room, f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("kvbroker writes into decode's device pages only (no host destinations)")
        targets = [info for info in self.bootstrap_infos if not info.get("is_dummy")]
        if len(targets) != 1:
            self.kv_mgr.fail(room, f"kvbroker moves a request from one prefill rank; this decode rank maps to "
                                   f"{len(targets)} (attention TP or PP differ between prefill and decode)")
            return
        target = targets[0]
        if not target.get("kvbroker_address") or not target.get("kvbroker_engine_id"):
            self.kv_mgr.fail(room, f"the prefill rank {target.get('rank_ip')}:{target.get('rank_port')} registered "
                                   "no kvbroker engine on its bootstrap server: run prefill with "
                                   "--disaggregation-transfer-backend kvbroker too")
            return
        pages = {Component.MAIN_KV: np.asarray(kv_indices, dtype=np.int64).reshape(-1)}
        for i in range(len(self.kv_mgr.kv_args.state_types or ())):
            indices = None if state_indices is None else state_indices[i]
            if indices is None:
                self.kv_mgr.fail(room, f"SGLang gave no pages for state {self.kv_mgr.kv_args.state_types[i]}")
                return
            pages[state_component_of(self.kv_mgr.kv_args, i)] = np.asarray(indices, dtype=np.int64).reshape(-1)
        # A component with no pages (decode's prefix holds all the main KV and index K) is not
        # granted: prefill sends none of it, and the broker grants only page lists it can fill.
        # With none at all (decode holds the whole prompt), only the aux row moves: aux_only.
        pages = {component: ids for component, ids in pages.items() if ids.size}
        deliveries = [(info, self.kv_mgr.build_receiver_metadata_message(
            bootstrap_room=room, required_dst_info_num=self.required_dst_info_num, kv_indices=kv_indices,
            aux_index=aux_index, state_indices=state_indices, decode_prefix_len=decode_prefix_len,
            is_dummy=bool(info.get("is_dummy")), aux_only=not pages)) for info in self.bootstrap_infos]
        if pages:
            self.kv_mgr.offer(self, target, pages, deliveries, aux_index)
        else:
            self.kv_mgr.expect_aux_only(self, deliveries, aux_index)
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        if self.kv_mgr.holding(self.bootstrap_room):
            return KVPoll.Transferring
        return super().poll()

    def _send_abort_notification(self, *, force_arm: bool = False):
        """SGLang's abort frames to prefill, then the grant cancelled on the broker. SGLang's deferred
        release holds the pages until every prefill rank acks the abort; here the broker's answer to
        the cancel (no write into the grant runs) is that ack, for each of them."""
        super()._send_abort_notification(force_arm=force_arm)
        room, generation, count = self.bootstrap_room, self._abort_generation, len(self.bootstrap_infos)
        self.kv_mgr.cancel_room(room, self.kv_mgr.failure_records.get(room, "aborted by SGLang decode"))
        if generation is not None:
            self.kv_mgr.when_quiesced(room, lambda: [self.kv_mgr.note_abort_ack(room, rank, generation)
                                                  for rank in range(count)])

    def clear(self) -> None:
        self.kv_mgr.cancel_unfinished(self.bootstrap_room)
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def failure_exception(self):
        code = self.kv_mgr.failure_code(self.bootstrap_room)
        try:
            super().failure_exception()
        except KVTransferError as exc:
            raise KvbrokerTransferError(exc.bootstrap_room, exc.failure_reason, code=code,
                                        is_from_another_rank=exc.is_from_another_rank) from None


class KvbrokerKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server; a prefill rank's /route row also names its broker and engine."""

    def __init__(self, host: str, port: int):
        self.kvbroker_ranks: dict[tuple[int, int, int, int], dict] = {}
        super().__init__(host, port)

    async def _handle_route_put(self, request: web.Request):
        data = await request.json()
        response = await super()._handle_route_put(request)
        entry = data.get("kvbroker")
        if response.status == 200 and isinstance(entry, dict):
            dp_group = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            key = (int(dp_group), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
            async with self.lock:
                self.kvbroker_ranks[key] = {"kvbroker_address": str(entry.get("broker_address", "")),
                                            "kvbroker_engine_id": str(entry.get("engine_id", ""))}
        return response

    async def _handle_route_get(self, request: web.Request):
        response = await super()._handle_route_get(request)
        query = request.query
        try:
            key = tuple(int(query[k]) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                                                "target_pp_rank"))
        except (KeyError, ValueError):
            return response
        if response.status != 200 or key[0] == -1:
            return response
        async with self.lock:
            entry = self.kvbroker_ranks.get(key)
        if entry is None:
            return response
        return web.json_response({**json.loads(response.body), **entry}, status=200)

    def close(self) -> None:
        """SGLang's close, after ending the server's own cleanup task (upstream leaves it pending)."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            for task in list(self._background_tasks):
                loop.call_soon_threadsafe(task.cancel)
        super().close()
