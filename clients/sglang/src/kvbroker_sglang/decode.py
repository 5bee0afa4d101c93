"""The decode role: DecodeKVManager (a rank's manager in decode mode) and KvbrokerKVReceiver.

    frames      the rank's registration and, per room, its metadata to prefill (SGLang's own
                discovery and ZMQ frames, wire.py), sent from SGLang's thread as upstream sends them
    grant       then ReceivingRequest.grant: the destination pages per component offered to the
                prefill rank's broker while prefill computes, and followed to its end in the same
                command (WaitingForInput until then); the aux row written before Success
    abort       SGLang's abort frames, then the grant cancelled; the broker's answer (no write
                into the grant runs) is every prefill rank's ack of SGLang's deferred release
    aux-only    aux_only.AuxOnlyDecode: decode holds the whole prompt, no grant, prefill's Outcome frame
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from kvbroker_client import Component
from kvbroker_client.adapter import ReceivingRequest
from kvbroker_client.adapter.aux import AuxError, decode_aux, write_aux
from kvbroker_sglang.aux_only import AuxOnlyDecode
from kvbroker_sglang.layout import state_component_of
from kvbroker_sglang.manager import BrokerFailure, KvbrokerKVManager, Room
from kvbroker_sglang.sglang_0_5_23 import ReceiverSurface
from kvbroker_sglang.wire import OUTCOME_TAG, Metadata, Outcome, Registration, WireError

log = logging.getLogger(__name__)


@dataclass
class DecodeRoom(Room[ReceivingRequest]):
    aux_index: int | None = None  # where this request's aux rows go
    aux_only: bool = False  # decode holds the whole prompt: no grant, the aux row comes as an Outcome frame


class DecodeKVManager(AuxOnlyDecode, KvbrokerKVManager[DecodeRoom, ReceivingRequest]):
    room_class = DecodeRoom

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._threads.append(self.start_heartbeat())
        except BaseException:
            self.close()
            raise

    def new_request(self, room: int) -> ReceivingRequest:
        return ReceivingRequest(self.link, str(room), on_change=lambda r: self.on_request_change(room, r))

    @property
    def grant_expiry_s(self) -> float:
        """Decode's grants live as long as SGLang waits for their transfer (SGLANG_DISAGGREGATION_WAITING_TIMEOUT,
        300 s), not the broker's shorter default: a request may wait in prefill's queue that long."""
        if self.settings.grant_expiry_s is not None:
            return self.settings.grant_expiry_s
        return float(self.waiting_timeout)

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

    # -- prefill's frames (aux-only outcomes) ------------------------------------------------------
    def on_control(self, frames: list[bytes]) -> None:
        tag = frames[0] if frames else b""
        if tag != OUTCOME_TAG:
            raise WireError(f"unknown control frame {tag[:32]!r} for a decode rank")
        self.on_outcome(Outcome.from_frames(frames))

    # -- the grant ---------------------------------------------------------------------------------
    def offer(self, receiver: KvbrokerKVReceiver, target: dict, pages: dict[Component, np.ndarray],
              deliveries: list[tuple[dict, list[bytes]]], aux_index: int | None) -> None:
        """SGLang's thread (send_metadata): the metadata frame goes to prefill from here, as upstream
        sends it, and then the grant starts on the loop, travelling while prefill runs its forward
        (the offer's round trip was on the time to first token). The frame goes first: once the
        loop thread wakes for the offer it holds the GIL, and the frame would wait for it.
        Prefill's watch, parts and cancel wait for the offer at its broker; an offer that fails
        fails the room, and SGLang then aborts it at prefill. A frame that cannot be sent fails the
        room before any offer is made (the abort tells the ranks that got one)."""
        room = receiver.bootstrap_room
        state = self.room(room)
        state.aux_index = aux_index
        for info, frames in deliveries:
            try:
                receiver.push_to_prefill(info, frames)
            except zmq.ZMQError as exc:
                self.fail(room, f"metadata to prefill {info.get('rank_ip')}:{info.get('rank_port')} failed: {exc}")
                return
        state.request.grant(pages, sender_address=target["kvbroker_address"],
                            sender_engine_id=target["kvbroker_engine_id"], expiry_s=self.grant_expiry_s,
                            accept_aux=lambda aux: self.write_aux(room, aux))

    def land_aux(self, room: int, aux: bytes) -> bool:
        """Prefill's aux rows into this room's metadata slot; False (the room failed) if they do not fit."""
        try:
            self.write_aux(room, aux)
        except AuxError as exc:
            self.fail(room, f"kvbroker aux: {exc}")
            return False
        return True

    def write_aux(self, room: int, aux: bytes) -> None:
        """Prefill's aux rows into this room's metadata slot; AuxError if they do not fit."""
        state = self._rooms.get(room)
        index = None if state is None else state.aux_index
        if index is None:
            return
        rows = decode_aux(aux)
        if len(rows) != len(self.kv_args.aux_data_ptrs):
            log.warning("kvbroker: request %s: prefill sent %d aux rows, this rank has %d buffers; the "
                        "first %d are written", room, len(rows), len(self.kv_args.aux_data_ptrs),
                        min(len(rows), len(self.kv_args.aux_data_ptrs)))
        lens, items = self.kv_args.aux_data_lens, self.kv_args.aux_item_lens
        if any((index + 1) * int(n) > int(total) for n, total in zip(items, lens)):
            raise AuxError(f"aux index {index} is past this rank's metadata buffers")
        write_aux(rows, self.kv_args.aux_data_ptrs, items, index)


class KvbrokerKVReceiver(BrokerFailure, ReceiverSurface, CommonKVReceiver):
    """Decode side of one request: discovery as CommonKVReceiver, then a grant offered to the prefill broker."""

    kv_mgr: DecodeKVManager

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

    def after_abort_frames(self, generation) -> None:
        """SGLang's abort frames went to prefill; now the grant is cancelled on the broker. SGLang's
        deferred release holds the pages until every prefill rank acks the abort; here the broker's
        answer to the cancel (no write into the grant runs) is that ack, for each of them."""
        room, count = self.bootstrap_room, len(self.bootstrap_infos)
        self.kv_mgr.cancel_room(room, self.kv_mgr.failure_records.get(room, "aborted by SGLang decode"))
        if generation is not None:
            self.kv_mgr.when_quiesced(room, lambda: [self.kv_mgr.note_abort_ack(room, rank, generation)
                                                  for rank in range(count)])

    def clear(self) -> None:
        self.kv_mgr.cancel_unfinished(self.bootstrap_room)
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)
