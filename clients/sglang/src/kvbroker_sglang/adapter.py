"""SGLang's PD disaggregation on a kvbroker sidecar: KVArgs in, a registered engine and KVPoll values out.

SGLang is not imported. Any object with KVArgs's attributes works, filled as upstream fills them
(`sglang/srt/disaggregation/base/conn.py` KVArgs, `utils.py` setup_state_kv_args):

    kv_data_ptrs, kv_data_lens, kv_item_lens                 the main KV cache, one entry per buffer
    state_types, state_data_ptrs, state_data_lens, state_item_lens   one list per state component

Buffer order as the upstream pools report it: MHA (`MHATokenToKVPool.get_contiguous_buf_infos`)
gives the K buffers of every layer, then the V buffers; MLA gives one latent buffer per layer;
`MINIMAX_INDEX_K` (`MiniMaxSparseKVPool.get_index_k_state_buf_infos`) one K-only buffer per
sparse layer. Item lens are bytes per page, so SGLang's page indices are kvbroker page ids as they
are, and the index component shares the main KV's page indices (its rows live at the same loc).

    engine_components(kv_args, topology, segments)    pointers mapped back to (segment, offset)
    KVPoll, kv_poll(state)                            broker states as SGLang's KVPoll numbers
    SGLangEngine                                      register(); decode: expect(); prefill: send();
                                                      both: poll(), failure(), wait(), abort(), forget()
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np

from kvbroker_client import (
    BrokerClient,
    BrokerError,
    BufferRole,
    Component,
    ComponentSpec,
    EngineInfo,
    LayerBuffer,
    Layout,
    Topology,
    TransferState,
    TransferStatus,
)
from kvbroker_client.errors import DeadlineExceeded, Unknown, from_status
from kvbroker_client.shm import SharedSegment
from kvbroker_client.tensors import SegmentMap, SharedPool

# SGLang StateType values (a str enum upstream) and the component each one becomes.
STATE_COMPONENTS = {
    "minimax_index_k": Component.MINIMAX_INDEX_K,
    # Not a StateType upstream (SGLang refuses index-with-value before PD starts); passed through so
    # that the broker's rule refuses it with UNIMPLEMENTED, in its one place.
    "minimax_index_kv": Component.MINIMAX_INDEX_KV,
}


class KVPoll(enum.IntEnum):
    """sglang.srt.disaggregation.base.conn.KVPoll, number for number."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_POLL = {
    None: KVPoll.Bootstrapping,  # the broker does not know the request yet
    TransferState.PENDING: KVPoll.WaitingForInput,  # granted / accepted, no byte moved
    TransferState.TRANSFERRING: KVPoll.Transferring,
    TransferState.SUCCEEDED: KVPoll.Success,
    TransferState.FAILED: KVPoll.Failed,
}


def kv_poll(state: TransferState | None) -> KVPoll:
    """The KVPoll value SGLang's scheduler expects for a request in `state` (None: not known yet)."""
    return _POLL[state]


def _state_name(state_type: Any) -> str:
    return str(getattr(state_type, "value", state_type)).lower()


def _buffers(kind: str, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int],
             keys: Sequence[tuple[int, BufferRole]], segments: SegmentMap) -> list[LayerBuffer]:
    if not len(ptrs) == len(lens) == len(item_lens) == len(keys):
        raise ValueError(f"{kind}: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} item lengths "
                         f"for {len(keys)} layer buffers")
    buffers = []
    for (layer, role), ptr, length, item_len in zip(keys, ptrs, lens, item_lens):
        try:
            memory = segments.resolve(int(ptr), int(length))
        except ValueError as exc:
            raise ValueError(f"{kind} layer {layer} {role.name}: {exc}") from None
        buffers.append(LayerBuffer(layer, role, memory, int(length), int(item_len)))
    return buffers


def _component(component: Component, layout: Layout, buffers: list[LayerBuffer]) -> ComponentSpec:
    return ComponentSpec(component, layout, min(b.length // b.item_len for b in buffers), tuple(buffers))


def main_kv_component(kv_args: Any, topology: Topology, segments: SegmentMap, *,
                      attention: Literal["mha", "mla"] | None = None) -> ComponentSpec:
    """MAIN_KV from kv_data_*: KV_SPLIT for MHA (all K, then all V), FLAT for MLA (one per layer).

    The layers are the topology's [start_layer, end_layer); `attention` None infers MHA or MLA
    from the pointer count (twice the layer count, or once).
    """
    layers = list(range(topology.start_layer, topology.end_layer))
    ptrs = list(kv_args.kv_data_ptrs)
    if attention is None:
        by_count = {2 * len(layers): "mha", len(layers): "mla"}
        if len(ptrs) not in by_count:
            raise ValueError(f"kv_data_ptrs: {len(ptrs)} buffers fit neither MHA (2 x {len(layers)} layers) "
                             f"nor MLA ({len(layers)} layers)")
        attention = by_count[len(ptrs)]
    if attention == "mha":
        keys = [(layer, BufferRole.K) for layer in layers] + [(layer, BufferRole.V) for layer in layers]
        layout = Layout.KV_SPLIT
    elif attention == "mla":
        keys = [(layer, BufferRole.FLAT) for layer in layers]
        layout = Layout.FLAT
    else:
        raise ValueError(f"attention: expected 'mha' or 'mla', got {attention!r}")
    buffers = _buffers(f"kv_data_ptrs ({attention.upper()})", ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens,
                       keys, segments)
    return _component(Component.MAIN_KV, layout, buffers)


def state_components(kv_args: Any, segments: SegmentMap, *,
                     index_layer_ids: Sequence[int] | None = None) -> list[ComponentSpec]:
    """One FLAT component per state type; the index's buffers belong to `index_layer_ids` in order."""
    out = []
    for i, state_type in enumerate(getattr(kv_args, "state_types", None) or ()):
        name = _state_name(state_type)
        if name not in STATE_COMPONENTS:
            raise ValueError(f"state_types[{i}]: {name!r} has no kvbroker component "
                             f"(supported: {', '.join(STATE_COMPONENTS)})")
        if index_layer_ids is None:
            raise ValueError(f"state_types[{i}]: {name!r} needs index_layer_ids, the global ids of the sparse "
                             "layers its buffers belong to")
        keys = [(int(layer), BufferRole.FLAT) for layer in index_layer_ids]
        buffers = _buffers(f"state_data_ptrs[{i}] ({name})", kv_args.state_data_ptrs[i],
                           kv_args.state_data_lens[i], kv_args.state_item_lens[i], keys, segments)
        out.append(_component(STATE_COMPONENTS[name], Layout.FLAT, buffers))
    return out


def engine_components(kv_args: Any, topology: Topology,
                      segments: SegmentMap | SharedPool | SharedSegment | Iterable, *,
                      attention: Literal["mha", "mla"] | None = None,
                      index_layer_ids: Sequence[int] | None = None) -> list[ComponentSpec]:
    """Every component of a KVArgs-shaped object; `segments` are the shared memory behind its pointers."""
    segment_map = SegmentMap.of(segments)
    return [main_kv_component(kv_args, topology, segment_map, attention=attention),
            *state_components(kv_args, segment_map, index_layer_ids=index_layer_ids)]


def _page_ids(indices: Any) -> np.ndarray:
    array = np.asarray(indices.cpu() if hasattr(indices, "cpu") else indices)  # numpy int32 or a torch tensor
    return array.astype(np.int64).reshape(-1)


class SGLangEngine:
    """One SGLang rank (a KVArgs) as a kvbroker engine, with SGLang's per-request polling.

    Decode side: `expect(room, kv_indices)` grants the pages and follows the request in the
    background. Prefill side: `send(room, kv_indices, peer_address=..., remote_engine_id=...)`.
    Both: `poll(room)` is SGLang's KVPoll without a round trip; `failure(room)` the typed error of a
    failed request; `wait(room)` its end. Request ids are SGLang's bootstrap rooms as strings.
    """

    def __init__(self, client: BrokerClient, engine_id: str, kv_args: Any, topology: Topology,
                 segments: SegmentMap | SharedPool | SharedSegment | Iterable, *,
                 attention: Literal["mha", "mla"] | None = None,
                 index_layer_ids: Sequence[int] | None = None) -> None:
        self.client = client
        self.engine_id = engine_id
        self.topology = topology
        self.components = engine_components(kv_args, topology, segments, attention=attention,
                                            index_layer_ids=index_layer_ids)
        self._states: dict[str, TransferState] = {}
        self._errors: dict[str, BrokerError] = {}
        self._followers: dict[str, asyncio.Task[TransferStatus | None]] = {}

    @property
    def transferable(self) -> tuple[Component, ...]:
        """The components a request moves by default: all registered ones."""
        return tuple(c.component for c in self.components)

    async def register(self, *, timeout: float | None = None) -> EngineInfo:
        return await self.client.register_engine(self.engine_id, self.topology, self.components, timeout=timeout)

    async def unregister(self, *, timeout: float | None = None) -> int:
        await self.close()
        return await self.client.unregister_engine(self.engine_id, timeout=timeout)

    # -- decode side ---------------------------------------------------------------------------
    async def expect(self, room: int | str, kv_indices: Any, *, expiry_s: float | None = None,
                     components: Iterable[Component] | None = None) -> TransferStatus:
        """Grant the prefill side these destination pages (SGLang's page indices) for request `room`."""
        rid = self._begin(room)
        status = await self.client.expect_transfer(
            self.engine_id, rid, _page_ids(kv_indices), components=components or self.transferable,
            expiry_s=expiry_s)
        self._note(rid, status.state)
        self._followers[rid] = asyncio.create_task(self._follow(rid), name=f"kvbroker watch {rid}")
        return status

    async def _follow(self, rid: str) -> TransferStatus | None:
        last = None
        try:
            async for status in self.client.watch(self.engine_id, rid):
                last = status
                self._note(rid, status.state)
        except BrokerError as exc:
            self._fail(rid, exc)
            return last
        if last is not None and last.state is TransferState.FAILED:
            self._fail(rid, from_status(last))
        return last

    # -- prefill side --------------------------------------------------------------------------
    async def send(self, room: int | str, kv_indices: Any, *, peer_address: str, remote_engine_id: str,
                   dst_kv_indices: Any = (), components: Iterable[Component] | None = None,
                   timeout: float | None = None) -> TransferStatus:
        """Move request `room`'s pages (SGLang's page indices) to the decode engine; raises on failure."""
        rid = self._begin(room)
        self._note(rid, TransferState.TRANSFERRING)
        try:
            status = await self.client.transfer(
                self.engine_id, rid, peer_address, remote_engine_id, _page_ids(kv_indices),
                dst_page_ids=_page_ids(dst_kv_indices), components=components or self.transferable,
                timeout=timeout)
        except BrokerError as exc:
            self._fail(rid, exc)
            raise
        self._note(rid, status.state)
        return status

    # -- both sides ----------------------------------------------------------------------------
    def poll(self, room: int | str) -> KVPoll:
        return kv_poll(self._states.get(str(room)))

    def failure(self, room: int | str) -> BrokerError | None:
        """Why request `room` failed (SGLang's failure_exception raises this), None if it has not."""
        return self._errors.get(str(room))

    async def wait(self, room: int | str, *, timeout: float | None = None) -> TransferStatus:
        """The request's final status when it succeeded; its typed error otherwise."""
        rid = str(room)
        follower = self._followers.get(rid)
        if follower is None:
            return await self.client.wait(self.engine_id, rid, timeout=timeout)
        try:
            await asyncio.wait_for(asyncio.shield(follower), timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"request {rid!r} did not end within {timeout}s") from None
        if (error := self._errors.get(rid)) is not None:
            raise error
        status = follower.result()
        if status is None or status.state is not TransferState.SUCCEEDED:
            raise Unknown(f"the watch of request {rid!r} ended before a terminal state")
        return status

    async def abort(self, room: int | str, reason: str = "aborted by SGLang") -> TransferStatus:
        return await self.client.cancel(self.engine_id, str(room), reason)

    def forget(self, room: int | str) -> None:
        """Drop what this adapter keeps about a request (SGLang's clear())."""
        rid = str(room)
        self._states.pop(rid, None)
        self._errors.pop(rid, None)
        follower = self._followers.pop(rid, None)
        if follower is not None:
            follower.cancel()

    async def close(self) -> None:
        followers = list(self._followers.values())
        for follower in followers:
            follower.cancel()
        if followers:
            await asyncio.wait(followers, timeout=5)
        self._followers.clear()

    def _begin(self, room: int | str) -> str:
        rid = str(room)
        self._states.pop(rid, None)
        self._errors.pop(rid, None)
        return rid

    def _note(self, rid: str, state: TransferState) -> None:
        if self._states.get(rid) is not TransferState.FAILED:
            self._states[rid] = state

    def _fail(self, rid: str, error: BrokerError) -> None:
        self._states[rid] = TransferState.FAILED
        self._errors.setdefault(rid, error)
