"""KvbrokerKVManager: what SGLang's get_kv_class returns for MANAGER, and what both roles' managers share.

SGLang builds one manager per rank with its mode; `KvbrokerKVManager(...)` is a PrefillKVManager
(prefill.py) or a DecodeKVManager (decode.py), chosen in `__new__`, the one place that looks at the
mode. What both share is on one screen here:

    startup     the engine's components and topology (layout.py's tables) registered through an
                EngineLink (kvbroker_client.adapter); the control thread on SGLang's server socket
    rooms       one per bootstrap room: the core's request and what SGLang needs beside it
    phases      the request's phases into SGLang's request_status (KVPoll), its failure into
                failure_records; SGLang's own failures (update_status Failed) cancel the request
    holding     poll() says Transferring while the request's cancel has not answered: SGLang frees
                nothing a transfer may still touch
    close       threads, the link (the broker releases the engine), SGLang's cached sockets
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import zmq
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager, KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_parallel

from kvbroker_client.adapter import AdapterSettings, EngineLink, Failure, Phase
from kvbroker_client.adapter.memory import MemoryExporter, NotExportable
from kvbroker_client.adapter.request import Request
from kvbroker_sglang.host_pools import HOST_HINT
from kvbroker_sglang.layout import engine_components, engine_topology
from kvbroker_sglang.sglang_0_5_23 import ManagerSurface
from kvbroker_sglang.wire import WireError

if TYPE_CHECKING:  # mixed into CommonKVSender and CommonKVReceiver, which are untyped: Any to mypy
    _SenderOrReceiver = Any
else:
    _SenderOrReceiver = object

log = logging.getLogger(__name__)

# SGLang's KVPoll for each phase the broker reports (FAILED goes through failure_records).
KVPOLL_OF_PHASE = {Phase.WAITING: "WaitingForInput", Phase.TRANSFERRING: "Transferring", Phase.SUCCEEDED: "Success"}


class KvbrokerTransferError(KVTransferError):
    """SGLang's KVTransferError with the broker's status code (`code`, a grpc.StatusCode) when it has one."""

    def __init__(self, bootstrap_room: int, failure_reason: str, *, code=None, is_from_another_rank: bool = False):
        super().__init__(bootstrap_room, failure_reason, is_from_another_rank)
        self.code = code


class BrokerFailure(_SenderOrReceiver):
    """Mixed into the sender and the receiver: SGLang's failure, with the broker's code."""

    def failure_exception(self):
        code = self.kv_mgr.failure_code(self.bootstrap_room)  # before SGLang's clear() forgets the room
        try:
            super().failure_exception()
        except KVTransferError as exc:
            raise KvbrokerTransferError(exc.bootstrap_room, exc.failure_reason, code=code,
                                        is_from_another_rank=exc.is_from_another_rank) from None


Q = TypeVar("Q", bound=Request)  # a role's request


@dataclass
class Room(Generic[Q]):
    """What the manager keeps of one request beside SGLang's request_status."""

    request: Q
    cleared: bool = False  # SGLang cleared the room while its cancel ran: forget it once that answers
    watched: bool = False  # the request's cancel reports back here (`_cancel_answered`)


R = TypeVar("R", bound="Room[Any]")  # a role's room


class KvbrokerKVManager(ManagerSurface, CommonKVManager, Generic[R, Q]):
    """One SGLang rank's engine on its broker, and the requests it moves (see the module's map).
    Generic in its role's room and request (PrefillKVManager, DecodeKVManager)."""

    # Deferred decode KV release: the broker's cancel answering stands for the prefill's drain ACK.
    supports_deferred_decode_kv_release = True

    def __new__(cls, args: KVArgs, disaggregation_mode: DisaggregationMode, *rest, **kwargs):
        if cls is KvbrokerKVManager:
            if disaggregation_mode == DisaggregationMode.PREFILL:
                from kvbroker_sglang.prefill import PrefillKVManager as cls
            else:
                from kvbroker_sglang.decode import DecodeKVManager as cls
        return super().__new__(cls)

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend=False):
        self.settings = AdapterSettings.from_env()
        self.link: EngineLink | None = None
        self._rooms: dict[int, R] = {}
        self._rooms_lock = threading.RLock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        try:
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            self._open()  # prefill opened it already, to PUT its broker on /route
            self._start_thread(self._control_loop, "kvbroker control")
        except BaseException:
            self.close()
            raise

    # -- startup and shutdown ------------------------------------------------------------------
    @property
    def engine_id(self) -> str:
        return "" if self.link is None else self.link.engine_id

    @property
    def broker_address(self) -> str:
        return "" if self.link is None else self.link.broker_address

    @property
    def broker_id(self) -> str:
        return "" if self.link is None else self.link.broker_id

    def _open(self) -> None:
        if self.link is not None:
            return
        mode = self.disaggregation_mode.value
        engine_id = (f"{self.settings.engine_prefix}/{mode}/dp{self.system_dp_rank}-tp{self.kv_args.engine_rank}"
                     f"-pp{self.pp_rank}")
        exporter = MemoryExporter(host_hint=HOST_HINT)
        for i, ptr in enumerate(self.kv_args.aux_data_ptrs):
            if exporter.is_device_memory(int(ptr)):
                raise NotExportable(f"aux_data_ptrs[{i}] is GPU memory: kvbroker moves SGLang's metadata rows as "
                                    "bytes read on the host; unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
        components = engine_components(self.kv_args, exporter.refs, is_mla=bool(self.is_mla_backend))
        parallel = get_parallel()
        tp_size = parallel.tp_size if hasattr(parallel, "tp_size") else self.attn_tp_size
        topology = engine_topology(self.kv_args, components, tp_size=tp_size,
                                   tp_rank=self.kv_args.engine_rank, attn_tp_size=self.attn_tp_size,
                                   attn_tp_rank=self.attn_tp_rank, pp_size=self.pp_size, pp_rank=self.pp_rank,
                                   dp_rank=self.system_dp_rank)
        link = EngineLink(self.settings, engine_id, holder=f"sglang {mode} {engine_id} pid {os.getpid()}")
        link.open(topology, components)
        self.link = link

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Stop the threads, end every task, close the session (the broker then releases the engine)."""
        self._stopping.set()
        self.stop_heartbeat()
        for thread in self._threads:
            thread.join(5)
        if self.link is not None:
            self.link.close()
        for socket_ in [*self.close_cached_sockets(), getattr(self, "server_socket", None)]:
            if socket_ is not None:
                socket_.close(linger=0)

    # -- the control socket: frames from the other side's ranks --------------------------------------
    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):  # wakes to see _stopping; frames are handled as they come
                continue
            frames = self.server_socket.recv_multipart()
            try:
                self.on_control(frames)
            except (WireError, ValueError) as exc:
                log.warning("kvbroker: dropping a control frame: %s", exc)

    def on_control(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    # -- rooms: the core's request and SGLang's request_status ------------------------------------
    def new_request(self, room: int) -> Q:
        raise NotImplementedError

    room_class: type[R]  # each role's

    def room(self, room: int) -> R:
        with self._rooms_lock:
            state = self._rooms.get(room)
            if state is None:
                state = self._rooms[room] = self.room_class(self.new_request(room))
            return state

    def request_of(self, room: int) -> Q | None:
        state = self._rooms.get(room)
        return None if state is None else state.request

    def on_request_change(self, room: int, request: Request) -> None:
        """The core's phase into SGLang's request_status (on the link's loop)."""
        if request.phase is Phase.FAILED:
            self._record_failure(room, request.failure or Failure("request failed"))
        elif request.phase in KVPOLL_OF_PHASE:
            self.update_status(room, getattr(KVPoll, KVPOLL_OF_PHASE[request.phase]))

    def _record_failure(self, room: int, failure: Failure) -> None:
        with self._rooms_lock:
            if self.request_status.get(room) in (None, KVPoll.Success, KVPoll.Failed):
                return
            with self.failure_lock:
                self.failure_records.setdefault(room, failure.reason)
        self.update_status(room, KVPoll.Failed)

    def update_status(self, bootstrap_room: int, status: KVPoll):
        with self._rooms_lock:
            super().update_status(bootstrap_room, status)
        if status == KVPoll.Failed:
            reason = self.failure_records.get(bootstrap_room, "request failed")
            self.cancel_room(bootstrap_room, reason)
            request = self.request_of(bootstrap_room)
            if request is not None:
                request.fail(reason)
            self.on_failed(bootstrap_room, reason)

    def on_failed(self, room: int, reason: str) -> None:
        """A role's own step once a room failed (after its cancel started)."""

    def fail(self, room: int, reason: str, code=None) -> None:
        """Record the first root cause of a room's failure (and the broker's code) and mark it Failed."""
        if self.request_status.get(room) in (None, KVPoll.Success):
            return
        request = self.request_of(room)
        if request is not None:
            request.fail(reason, code)  # on_request_change records it, if the request had not ended
            if request.phase is Phase.FAILED and request.failure is not None:  # it has one once FAILED
                self._record_failure(room, request.failure)
                return
        self._record_failure(room, Failure(reason, code))

    def cancel_room(self, room: int, reason: str, *, unknown_reason: str | None = None) -> None:
        """Cancel the room's request on the broker, once; the broker answers when no write into it runs.
        Only requests the broker may hold are cancelled (the core's `offered`)."""
        with self._rooms_lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.request.cancel(reason, unknown_reason=unknown_reason)
            if state.request.cancelled and not state.watched:
                state.watched = True
                state.request.when_cancelled(lambda: self._cancel_answered(room))

    def _cancel_answered(self, room: int) -> None:
        state = self._rooms.get(room)
        if state is not None and state.cleared:
            self.forget(room)
        else:
            self.cancel_settled(room)

    def cancel_settled(self, room: int) -> None:
        """A role's own step once a room's cancel answered and SGLang still holds the room."""

    def holding(self, room: int) -> bool:
        """Whether SGLang must not free the room's pages yet (the core's `holding`). A prefill room no
        part left for is still in SGLang's bootstrap queue, which takes no Transferring (pop_bootstrapped
        raises on it): the sending request holds only once a part was sent. See clients/README.md."""
        request = self.request_of(room)
        return request is not None and request.holding

    def forget(self, room: int) -> None:
        """SGLang cleared the room: drop what is kept of it, now or, while its cancel runs, once it answers."""
        with self._rooms_lock:
            state = self._rooms.get(room)
            if state is None:
                return
            if state.request.cancelling:
                state.cleared = True
                return
            del self._rooms[room]
        state.request.stop_watching()

    def failure_code(self, room: int):
        request = self.request_of(room)
        return None if request is None or request.failure is None else request.failure.code

    def cancel_unfinished(self, room: int) -> None:
        """SGLang clears a room it no longer follows: one that has not ended must not stay writable
        on the broker until its grant expires."""
        if self.request_status.get(room) not in (None, KVPoll.Success, KVPoll.Failed):
            self.cancel_room(room, "SGLang cleared the request before its transfer ended")

    def when_quiesced(self, room: int, fn) -> None:
        """Call `fn()` once nothing can write into the room's pages: now, or when its cancel answers."""
        request = self.request_of(room)
        if request is None:
            fn()
        else:
            request.when_quiesced(fn)
