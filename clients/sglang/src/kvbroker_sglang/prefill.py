"""The prefill role: PrefillKVManager (a rank's manager in prefill mode) and KvbrokerKVSender.

    /route      the rank's row on SGLang's bootstrap server also names its broker and engine
    frames      decode's registration, its metadata per room (-> expect the offer: WaitingForInput
                at once, the watch waits for the offer at the broker) and its abort (-> cancel)
    parts       KvbrokerKVSender.send per chunk -> SendingRequest.send_part, in SGLang's order; the
                last carries the states and the aux row
    ending      a room that ended before decode's offer reached this broker is remembered
                (`_ended_early`): the late offer is refused at once, so decode fails then, not at
                SGLang's waiting timeout; a room decode's frame opened and that ended before SGLang
                made its sender is dropped here (no sender will clear it)
    aux-only    aux_only.AuxOnlyPrefill: decode holds the whole prompt, the aux row goes as a frame
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification, CommonKVSender

from kvbroker_client import Component
from kvbroker_client.adapter import Part, SendingRequest
from kvbroker_client.adapter.aux import encode_aux
from kvbroker_sglang.aux_only import AuxOnlyPrefill
from kvbroker_sglang.layout import state_component_of
from kvbroker_sglang.manager import BrokerFailure, KvbrokerKVManager, Room
from kvbroker_sglang.sglang_0_5_23 import SenderSurface
from kvbroker_sglang.wire import METADATA_TAG, REGISTER_TAG, Metadata, Outcome, Registration, WireError

log = logging.getLogger(__name__)

# How many rooms that ended before decode's frame came are remembered. Rooms are random 63-bit
# ids, so only a frame later than this many such endings finds none (and waits out its expiry).
ENDED_EARLY_ROOMS = 4096


@dataclass
class PrefillRoom(Room[SendingRequest]):
    has_sender: bool = False  # SGLang made the room's KVSender (decode's frame may come first)
    aux_only: bool = False  # decode holds the whole prompt: no offer, the aux row goes as an Outcome frame
    endpoint: str = ""  # aux-only: decode's control address, where the Outcome goes
    told: bool = False  # aux-only: the Outcome went


class PrefillKVManager(AuxOnlyPrefill, KvbrokerKVManager[PrefillRoom, SendingRequest]):
    room_class = PrefillRoom

    def __init__(self, *args, **kwargs) -> None:
        self.peers_changed = threading.Condition()  # notified when a decode rank registers
        self._ended_early: OrderedDict[int, str] = OrderedDict()  # room -> why, no frame came before
        super().__init__(*args, **kwargs)

    def new_request(self, room: int) -> SendingRequest:
        return SendingRequest(self.link, str(room), on_change=lambda r: self.on_request_change(room, r))

    def route_row(self, payload: dict) -> dict:
        self._open()
        return {**payload, "kvbroker": {"broker_address": self.broker_address, "engine_id": self.engine_id}}

    def on_failed(self, room: int, reason: str) -> None:
        self.tell_decode(room, Outcome(room, failure=reason))

    # -- decode's frames ------------------------------------------------------------------------
    def on_control(self, frames: list[bytes]) -> None:
        tag = frames[0] if frames else b""
        if tag == REGISTER_TAG:
            registration = Registration.from_frames(frames)
            with self.peers_changed:
                self.decode_kv_args_table[registration.endpoint] = registration
                self.peers_changed.notify_all()
            self.check_peer_aux_buffer_count(registration.endpoint, len(registration.aux_item_lens))
        elif tag == METADATA_TAG:
            self._on_metadata(Metadata.from_frames(frames))
        elif tag == ABORT_TAG:
            notification = AbortNotification.from_zmq(frames)
            if notification is not None:
                self._decode_aborted(notification.room)
        else:
            raise WireError(f"unknown control frame {tag[:32]!r} for a prefill rank")

    def _decode_aborted(self, room: int) -> None:
        """SGLang's abort frame from decode: the room fails with what the broker says of it.

        Decode's cancel revokes its grant at this broker too; whichever comes first, cancelling
        the room here answers with its failure (CANCELLED and the reason) once no part writes into it.
        """
        with self._rooms_lock:
            if self.request_status.get(room) in (None, KVPoll.Success):
                return  # gone already, or done: as upstream, an abort after Success changes nothing
            self.room(room).request.offered = True  # the offer may sit on this broker even before decode's metadata
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
            # and follows it from then; parts wait for it too. One that never comes, or is revoked
            # meanwhile, fails the room.
            self.update_status(room, KVPoll.WaitingForInput)
            watch = self.room(room).request.expect_offer()
            watch.add_done_callback(lambda _: self._drop_if_unclaimed(room))

    def _refuse_late_offer(self, room: int, meta: Metadata, reason: str) -> None:
        """Decode's frame for a room this rank already ended: its offer came after the room's cancel (which
        found nothing to cancel then), so it is refused now and decode's grant fails at once."""
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
        if self.link is not None and self.link.is_open:
            SendingRequest(self.link, str(room)).refuse_offer(reason)

    def ended_before_decode(self, room: int) -> None:
        """SGLang clears a room that did not succeed; if decode's frame never came, its offer may
        still come: remember why the room ended."""
        with self._rooms_lock:
            if room in self.transfer_infos or self.request_status.get(room) == KVPoll.Success:
                return
            with self.failure_lock:
                reason = self.failure_records.get(room, "the prefill side ended the request")
            self._ended_early[room] = reason
            while len(self._ended_early) > ENDED_EARLY_ROOMS:
                self._ended_early.popitem(last=False)

    def cancel_settled(self, room: int) -> None:
        self._drop_if_unclaimed(room)

    def _drop_if_unclaimed(self, room: int) -> None:
        """A room decode's frame opened that ended (its offer failed, its cancel answered) before SGLang
        made its sender: no sender will clear it, so it is dropped here."""
        with self._rooms_lock:
            state = self._rooms.get(room)
            if (state is None or state.has_sender or self.request_status.get(room) not in (KVPoll.Failed, None)
                    or state.request.cancelling):
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

    # -- parts ------------------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices=None, num_kv_tokens=None, *,
                             wait_event=None, indices_event=None, trace_ctx=None) -> None:
        """One chunk of a request (CommonKVSender.send): a part, in order, on the link's loop."""
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
        event = wait_event or indices_event  # SGLang's early send: the forward may still write these pages
        receiver = next((i.broker_id for i in infos.values() if not i.is_dummy), "")
        self.room(room).request.send_part(Part(
            pages, bool(is_last_chunk), {Component.MAIN_KV: int(index_slice.start)} if Component.MAIN_KV in pages
            else {}, aux, event.synchronize if event is not None else None, receiver))

    def _send_aux_only(self, room: int, kv_indices, is_last_chunk: bool, aux_index, state_indices) -> None:
        sent = len(kv_indices) + sum(len(x) for x in state_indices or () if x is not None)
        if sent:
            self.fail(room, f"decode holds the whole prompt and granted no page, but prefill sent {sent} page ids "
                            "for it")
        elif is_last_chunk:
            aux = b"" if aux_index is None else encode_aux(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens,
                                                           int(aux_index))
            self.tell_decode(room, Outcome(room, aux=aux))


class KvbrokerKVSender(BrokerFailure, SenderSurface, CommonKVSender):
    """Prefill side of one request: CommonKVSender's lifecycle, parts through the manager."""

    kv_mgr: PrefillKVManager

    def __init__(self, mgr: PrefillKVManager, bootstrap_addr: str, bootstrap_room: int, *args, **kwargs):
        mgr.claim(bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)

    def poll(self) -> KVPoll:
        if self.kv_mgr.holding(self.bootstrap_room):
            return KVPoll.Transferring
        status = super().poll()
        if status == KVPoll.Success:
            request = self.kv_mgr.request_of(self.bootstrap_room)
            if request is not None and request.final is not None:  # kept here: SGLang clears the room first
                self.record_transfer_metric(request.final.bytes, request.succeeded_at)
        return status

    def get_transfer_metric(self):
        """prefill.py logs it per request (latency, bytes, speed): the broker's bytes once it succeeded."""
        metric = self.transfer_metric()
        return super().get_transfer_metric() if metric is None else metric

    def poll_pp_consensus(self) -> KVPoll:
        if self.kv_mgr.holding(self.bootstrap_room):
            return KVPoll.Transferring
        return super().poll_pp_consensus()

    def abort(self) -> None:
        self.kv_mgr.room(self.bootstrap_room).request.offered = True  # decode's offer may sit on our broker
        super().abort()

    def clear(self) -> None:
        self.kv_mgr.cancel_unfinished(self.bootstrap_room)
        self.kv_mgr.ended_before_decode(self.bootstrap_room)
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)
