"""The peer plane's wire: translation between the PeerService messages and the domain's
dataclasses, both ways, for the peer clients (clients.py, the gRPC client side) and the peer
servicer (edge/peer_service.py, through edge/convert.py, which re-exports these), and a peer's
gRPC status back into a BrokerError (`from_rpc_error`).

- `engine_layout_in`/`_out` (Handshake), `grant_offer_in`/`_out` (OfferGrant), `part_notice_in`/
  `_out` and `part_ack_in`/`_out` (NotifyParts), with the shared pieces: `enum_in`/`enum_out` (by
  number: the domain's enums equal the proto's, tests/unit/test_enums.py), `page_ids_in`,
  `topology_in`/`_out`, `grant_pages_in`/`_out`.
Unknown enum values and missing fields become INVALID_ARGUMENT naming the field. Below the edge:
the peer clients never import kvbroker.edge (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import TypeVar, cast

import grpc
import numpy as np

from kvbroker.core.errors import BrokerError, Code, clip, invalid
from kvbroker.core.model import (
    BufferLayout,
    BufferRole,
    Component,
    ComponentLayout,
    EngineLayout,
    KvDtype,
    Layout,
    MemoryKind,
    Topology,
    TransferState,
)
from kvbroker.core.parts import Landed
from kvbroker.core.validation import (
    OFFER_TOKEN,
    check_components,
    check_grant_pages,
    check_identifier,
    check_peer_address,
    check_src_offsets,
)
from kvbroker.peers.link import GrantOffer, PartAck, PartNotice
from kvbroker_client.codes import code_number
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb

_PREFIX: dict[type[IntEnum], str] = {Component: "COMPONENT_", Layout: "LAYOUT_", BufferRole: "BUFFER_ROLE_",
                                     KvDtype: "KV_DTYPE_", MemoryKind: "MEMORY_KIND_"}


E = TypeVar("E", bound=IntEnum)
W = TypeVar("W", bound=int)


def enum_in(kind: type[E], value: int, field_name: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise invalid(f"{field_name}: {_PREFIX.get(kind, '')}{value} is not a known value "
                      f"(0 is UNSPECIFIED and never valid)") from None


def enum_out(value: int, wire: type[W]) -> W:
    """A domain enum's value as a message's enum field takes it: its number. `wire` (e.g. pb.Component)
    names the field's type only: the generated stubs type the field as the proto enum's class, which
    at run time is a wrapper around plain ints."""
    return cast(W, int(value))


def page_ids_in(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=len(values))


def topology_in(t: pb.Topology, field_name: str = "topology") -> Topology:
    return Topology(t.tp_size, t.tp_rank, t.attn_tp_size, t.attn_tp_rank, t.pp_size, t.pp_rank, t.dp_rank,
                    t.page_size, t.start_layer, t.end_layer, enum_in(KvDtype, t.kv_dtype, f"{field_name}.kv_dtype"))


def topology_out(t: Topology) -> pb.Topology:
    return pb.Topology(tp_size=t.tp_size, tp_rank=t.tp_rank, attn_tp_size=t.attn_tp_size,
                       attn_tp_rank=t.attn_tp_rank, pp_size=t.pp_size, pp_rank=t.pp_rank, dp_rank=t.dp_rank,
                       page_size=t.page_size, start_layer=t.start_layer, end_layer=t.end_layer,
                       kv_dtype=enum_out(t.kv_dtype, pb.KvDtype))


def engine_layout_out(layout: EngineLayout) -> ppb.PeerEngine:
    return ppb.PeerEngine(
        engine_id=layout.engine_id, topology=topology_out(layout.topology),
        components=[
            ppb.PeerComponent(
                component=enum_out(c.kind, pb.Component), layout=enum_out(c.layout, pb.Layout),
                num_pages=c.num_pages,
                layer_buffers=[ppb.PeerLayerBuffer(layer_id=b.layer_id, role=enum_out(b.role, pb.BufferRole),
                                                   address=b.address, length=b.length, item_len=b.item_len,
                                                   device=b.device,
                                                   memory_kind=enum_out(b.memory_kind, pb.MemoryKind))
                               for b in c.buffers],
            )
            for c in layout.components.values()
        ],
    )


def _memory_kind_in(value: int, field_name: str) -> MemoryKind:
    return MemoryKind.HOST if value == pb.MEMORY_KIND_UNSPECIFIED else enum_in(MemoryKind, value, field_name)


def engine_layout_in(e: ppb.PeerEngine) -> EngineLayout:
    where = "handshake.engine"
    components = {}
    for i, c in enumerate(e.components):
        kind = enum_in(Component, c.component, f"{where}.components[{i}].component")
        buffers = tuple(sorted(
            (BufferLayout(b.layer_id, enum_in(BufferRole, b.role, f"{where}.components[{i}].role"), b.address, b.length,
                          b.item_len, b.device, _memory_kind_in(b.memory_kind, f"{where}.components[{i}].memory_kind"))
             for b in c.layer_buffers),
            key=lambda b: (b.layer_id, b.role),
        ))
        components[kind] = ComponentLayout(kind, enum_in(Layout, c.layout, f"{where}.components[{i}].layout"),
                                           c.num_pages, buffers)
    kinds = {b.memory_kind for c in components.values() for b in c.buffers}
    if len(kinds) > 1:
        raise invalid(f"{where}: the peer engine's layer buffers mix host and GPU memory")
    return EngineLayout(e.engine_id, topology_in(e.topology, f"{where}.topology"), components)


def grant_pages_in(values, field_name: str = "pages") -> list[tuple[Component, np.ndarray]]:
    """ComponentPages messages: (component, page ids) in request order."""
    return [(enum_in(Component, p.component, f"{field_name}[{i}].component"), page_ids_in(p.page_ids))
            for i, p in enumerate(values)]


def grant_pages_out(granted: dict[Component, np.ndarray],
                    src_offsets: Mapping[Component, int] | None = None) -> list[pb.ComponentPages]:
    offsets = src_offsets or {}
    return [pb.ComponentPages(component=enum_out(k, pb.Component), page_ids=v.tolist(), src_offset=offsets.get(k, 0))
            for k, v in granted.items()]


def src_offsets_in(values) -> list[tuple[Component, int]]:
    """ComponentPages messages' src_offset (checked by check_src_offsets): (component, offset) in order."""
    return [(Component(p.component), p.src_offset) for p in values]


def grant_offer_out(offer: GrantOffer, broker_id: str, epoch: int) -> ppb.OfferGrantRequest:
    return ppb.OfferGrantRequest(
        broker_id=broker_id, epoch=epoch, peer_address=offer.peer_address, engine_id=offer.engine_id,
        request_id=offer.request_id, sender_engine_id=offer.sender_engine_id,
        pages=grant_pages_out(offer.granted, offer.src_offsets), remaining_ms=max(1, int(offer.remaining_s * 1000)),
        offer_token=offer.token, generation=offer.generation,
    )


def grant_offer_in(req: ppb.OfferGrantRequest, max_pages: int) -> GrantOffer:
    """An offer as received: ids, token and every page list checked before anything is kept."""
    check_identifier(req.engine_id, "engine_id")
    check_identifier(req.request_id, "request_id")
    if req.sender_engine_id:
        check_identifier(req.sender_engine_id, "sender_engine_id")
    check_peer_address(req.peer_address, "peer_address")
    if not OFFER_TOKEN.fullmatch(req.offer_token):
        raise invalid("offer_token: must be 32 hex digits")
    # The components before any page list is converted: a list named twice (or an unsupported
    # component) costs a million-id conversion otherwise, 0.1 CPU-second a 9 MB offer.
    check_components([enum_in(Component, p.component, f"pages[{i}].component") for i, p in enumerate(req.pages)],
                     "pages")
    granted = check_grant_pages(None, grant_pages_in(req.pages), "pages", max_pages)
    offsets = check_src_offsets(src_offsets_in(req.pages), granted, offered=True, max_pages=max_pages)
    return GrantOffer(req.peer_address, req.engine_id, req.request_id, req.sender_engine_id, granted,
                      req.remaining_ms / 1000, req.offer_token, req.generation, offsets)


def part_notice_out(n: PartNotice) -> ppb.PartNotice:
    return ppb.PartNotice(
        engine_id=n.engine_id, request_id=n.request_id, offer_token=n.token, part=n.part,
        parts_total=n.parts_total, succeeded=n.succeeded, code=n.code, reason=clip(n.reason),
        landed=[ppb.PartLanded(component=enum_out(x.kind, pb.Component), dst_offset=x.dst_offset, pages=x.pages)
                for x in n.landed],
        aux=n.aux,
    )


def part_notice_in(n: ppb.PartNotice, field_name: str) -> PartNotice:
    landed = tuple(Landed(enum_in(Component, x.component, f"{field_name}.landed[{j}].component"), x.dst_offset,
                          x.pages) for j, x in enumerate(n.landed))
    return PartNotice(n.engine_id, n.request_id, n.offer_token, n.part, n.parts_total, n.succeeded, landed,
                      n.aux, n.code, n.reason)


def part_ack_out(ack: PartAck) -> ppb.PartAck:
    state = pb.TRANSFER_STATE_UNSPECIFIED if ack.state is None else enum_out(ack.state, pb.TransferState)
    return ppb.PartAck(state=state, code=ack.code, reason=ack.reason)


def completion_state_in(state: int, address: str) -> TransferState:
    """A CompleteTransfer answer's state: one of ours, else ABORTED (the receiver is broken)."""
    try:
        return TransferState(state)
    except ValueError:
        raise BrokerError(Code.ABORTED, f"peer broker {address}: receiver reports unknown state {state} "
                                        "for the grant") from None


def part_ack_in(ack: ppb.PartAck, address: str) -> PartAck:
    try:
        state = None if ack.state == 0 else TransferState(ack.state)
    except ValueError:
        raise BrokerError(Code.ABORTED, f"peer broker {address}: receiver reports unknown state {ack.state}") from None
    return PartAck(state, ack.code, ack.reason)


def from_rpc_error(exc: grpc.aio.AioRpcError, prefix: str) -> BrokerError:
    """A peer's status becomes ours, with the peer named (from_status)."""
    return from_status(code_number(exc.code()), exc.details() or exc.code().name, prefix)


def from_status(number: int, details: str, prefix: str) -> BrokerError:
    """A peer's status code number and message become ours, with the peer named. A status outside
    our table (UNKNOWN, DATA_LOSS, OUT_OF_RANGE: the transport or a broken peer) and the peer's own
    INTERNAL (its bug, not ours) become UNAVAILABLE; UNAUTHENTICATED becomes PERMISSION_DENIED
    (DESIGN.md's peer that failed authentication)."""
    if number == code_number(grpc.StatusCode.UNAUTHENTICATED):
        return BrokerError(Code.PERMISSION_DENIED, f"{prefix}: {details}")
    try:
        domain = Code(number)
    except ValueError:
        domain = Code.UNAVAILABLE
    if domain is Code.INTERNAL:
        domain = Code.UNAVAILABLE
    return BrokerError(domain, f"{prefix}: {details}")
