"""A request whose whole prompt decode already holds: no page to grant, only the aux row to move.

Decode's radix cache can hold every token of a prompt (the same prompt sent twice). SGLang then
sends prefill `decode_prefix_len` = the prompt's length, prefill computes the first output token
and sends a last chunk with no pages, and its Mooncake backend moves the aux row alone (over TCP,
or by RDMA into decode's metadata buffer) and reports Success. A broker grants only page lists it
can fill, so kvbroker does it as Mooncake's TCP path does, beside the broker:

    decode  send_metadata with no pages -> no grant; Metadata(aux_only) pushed to each prefill rank
    prefill the frame: WaitingForInput at once (no offer to watch)
            the last chunk (no pages): Outcome(aux rows) pushed to decode's control socket -> Success
            the room failing first (its abort, its bootstrap timeout): Outcome(failure) instead
    decode  its control thread takes the Outcome: aux rows written -> Success, or Failed with the reason

Nothing writes into decode's pages, so neither side holds any: poll() never says Transferring here.
Each role's part is a mixin of its manager (AuxOnlyDecode, AuxOnlyPrefill); they use its rooms, its
link's loop and SGLang's request_status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.utils.network import NetworkAddress

from kvbroker_sglang.wire import Outcome

if TYPE_CHECKING:
    from kvbroker_client.adapter import EngineLink

log = logging.getLogger(__name__)


class _DecodeRoom(Protocol):  # decode.DecodeRoom
    aux_index: int | None
    aux_only: bool


class _PrefillRoom(Protocol):  # prefill.PrefillRoom
    aux_only: bool
    endpoint: str
    told: bool


class _Manager(Protocol):
    """What the mixins use of the manager they are mixed into (KvbrokerKVManager, SGLang's CommonKVManager)."""

    @property
    def link(self) -> EngineLink | None: ...

    @property
    def request_status(self) -> dict[int, Any]: ...  # SGLang's: room -> KVPoll

    def fail(self, room: int, reason: str, code: Any = None) -> None: ...

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None: ...


class _DecodeManager(_Manager, Protocol):  # decode.DecodeKVManager
    @property
    def _rooms(self) -> Mapping[int, _DecodeRoom]: ...

    def room(self, room: int) -> _DecodeRoom: ...

    def land_aux(self, room: int, aux: bytes) -> bool: ...


class _PrefillManager(_Manager, Protocol):  # prefill.PrefillKVManager
    @property
    def _rooms(self) -> Mapping[int, _PrefillRoom]: ...

    def send_frames(self, address: NetworkAddress, frames: list[bytes]) -> None: ...


def control_address(endpoint: str) -> NetworkAddress:
    """A rank's control endpoint as the frames carry it ("ip:port")."""
    host, _, port = endpoint.rpartition(":")
    return NetworkAddress(host, int(port))


class AuxOnlyDecode:
    def expect_aux_only(self: _DecodeManager, receiver, deliveries: list[tuple[dict, list[bytes]]],
                        aux_index: int | None) -> None:
        """No grant: the metadata frames go to prefill as they are; its Outcome ends the room."""
        room = receiver.bootstrap_room
        state = self.room(room)
        state.aux_index, state.aux_only = aux_index, True

        async def push() -> None:
            for info, frames in deliveries:
                try:
                    await asyncio.to_thread(receiver.push_to_prefill, info, frames)
                except zmq.ZMQError as exc:
                    self.fail(room, f"metadata to prefill {info.get('rank_ip')}:{info.get('rank_port')} failed: {exc}")
                    return

        link = self.link
        assert link is not None, "the link is not open"  # it opens with the manager
        link.spawn(push(), name=f"aux-only metadata {room}")

    def on_outcome(self: _DecodeManager, outcome: Outcome) -> None:
        room = outcome.room
        state = self._rooms.get(room)
        if state is None or not state.aux_only or self.request_status.get(room) in (None, KVPoll.Failed):
            log.info("kvbroker: an outcome of request %s that this decode rank no longer waits for", room)
            return
        if outcome.failure:
            self.fail(room, outcome.failure)
        elif self.land_aux(room, outcome.aux):
            self.update_status(room, KVPoll.Success)


class AuxOnlyPrefill:
    def tell_decode(self: _PrefillManager, room: int, outcome: Outcome) -> None:
        """Push `outcome` to the decode rank of an aux-only room, once; on the loop (ZMQ's send may block).
        Success is SGLang's once the frame is out, as Mooncake's is once its aux went."""
        state = self._rooms.get(room)
        link = self.link
        if state is None or not state.aux_only or state.told or link is None:
            return
        state.told = True
        address = control_address(state.endpoint)

        async def push() -> None:
            try:
                await asyncio.to_thread(self.send_frames, address, outcome.to_frames())
            except zmq.ZMQError as exc:
                self.fail(room, f"the aux row to decode {state.endpoint} failed: {exc}")
                return
            if not outcome.failure:
                self.update_status(room, KVPoll.Success)

        link.spawn(push(), name=f"outcome {room}")
