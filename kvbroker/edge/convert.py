"""Translation between the kvbroker.v1 messages and the domain's dataclasses, for both servicers
and the peer clients.

- into the domain: `engine_spec_in` (RegisterEngine), `components_in`, `page_ids_in`, `topology_in`,
  `enum_in` (by number: the domain's enums equal the proto's, tests/unit/test_enums.py), and
  `engine_layout_in` (a peer's Handshake answer, peer_clients.py);
- out of it: `status_out`, `component_spec_out`, `topology_out`, `memory_ownership_out`
  (service.py), `engine_layout_out` (Handshake, peer_service.py);
- the offered flow, both ways: `grant_pages_in`/`_out` and `part_pages_in` (ExpectTransfer,
  Transfer), `grant_offer_in`/`_out` (OfferGrant), `part_notice_in`/`_out` and `part_ack_in`/`_out`
  (NotifyParts).
Unknown enum values and missing fields become INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from kvbroker.core.errors import BrokerError, Code, invalid
from kvbroker.core.model import (
    BrokerAllocation,
    BufferLayout,
    BufferRole,
    Component,
    ComponentLayout,
    ComponentSpec,
    CudaIpcRef,
    EngineLayout,
    EngineSpec,
    KvDtype,
    LayerBuffer,
    Layout,
    MemoryKind,
    SharedMemoryRef,
    Topology,
    TransferState,
)
from kvbroker.core.parts import Landed
from kvbroker.core.validation import OFFER_TOKEN, check_grant_pages, check_identifier, check_peer_address
from kvbroker.flows.transfers import TransferStatus
from kvbroker.peers.link import GrantOffer, PartAck, PartNotice
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb

E = TypeVar("E")

_PREFIX = {Component: "COMPONENT_", Layout: "LAYOUT_", BufferRole: "BUFFER_ROLE_", KvDtype: "KV_DTYPE_",
           MemoryKind: "MEMORY_KIND_"}


def enum_in(kind: type[E], value: int, field_name: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise invalid(f"{field_name}: {_PREFIX.get(kind, '')}{value} is not a known value "
                      f"(0 is UNSPECIFIED and never valid)") from None


def page_ids_in(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=len(values))


def topology_in(t: pb.Topology, field_name: str = "topology") -> Topology:
    return Topology(t.tp_size, t.tp_rank, t.attn_tp_size, t.attn_tp_rank, t.pp_size, t.pp_rank, t.dp_rank,
                    t.page_size, t.start_layer, t.end_layer, enum_in(KvDtype, t.kv_dtype, f"{field_name}.kv_dtype"))


def topology_out(t: Topology) -> pb.Topology:
    return pb.Topology(tp_size=t.tp_size, tp_rank=t.tp_rank, attn_tp_size=t.attn_tp_size,
                       attn_tp_rank=t.attn_tp_rank, pp_size=t.pp_size, pp_rank=t.pp_rank, dp_rank=t.dp_rank,
                       page_size=t.page_size, start_layer=t.start_layer, end_layer=t.end_layer,
                       kv_dtype=int(t.kv_dtype))


def _memory_in(m: pb.MemoryRef) -> SharedMemoryRef | CudaIpcRef | None:
    which = m.WhichOneof("kind")
    if which == "shared_memory":
        return SharedMemoryRef(m.shared_memory.name, m.shared_memory.offset)
    if which == "cuda_ipc":
        c = m.cuda_ipc
        return CudaIpcRef(c.handle, c.device, c.offset, c.allocation_size)
    return None


def _memory_out(m: SharedMemoryRef | CudaIpcRef | None) -> pb.MemoryRef:
    if isinstance(m, SharedMemoryRef):
        return pb.MemoryRef(shared_memory=pb.SharedMemoryRef(name=m.name, offset=m.offset))
    if isinstance(m, CudaIpcRef):
        return pb.MemoryRef(cuda_ipc=pb.CudaIpcRef(handle=m.handle, device=m.device, offset=m.offset,
                                                   allocation_size=m.allocation_size))
    return pb.MemoryRef()


def _broker_allocation_in(req: bpb.RegisterEngineRequest) -> BrokerAllocation | None:
    ownership = req.memory_ownership
    if ownership in (bpb.MEMORY_OWNERSHIP_UNSPECIFIED, bpb.MEMORY_OWNERSHIP_SERVER):
        if req.allocation_device:
            raise invalid(f"allocation_device: {req.allocation_device} is set, but only MEMORY_OWNERSHIP_BROKER "
                          "allocates; leave it 0")
        return None
    if ownership == bpb.MEMORY_OWNERSHIP_BROKER:
        return BrokerAllocation(req.allocation_device)
    raise invalid(f"memory_ownership: MEMORY_OWNERSHIP_{ownership} is not a known value")


def memory_ownership_out(spec: EngineSpec) -> int:
    return bpb.MEMORY_OWNERSHIP_SERVER if spec.broker_allocation is None else bpb.MEMORY_OWNERSHIP_BROKER


def engine_spec_in(req: bpb.RegisterEngineRequest) -> EngineSpec:
    if not req.HasField("topology"):
        raise invalid("topology: is required")
    allocation = _broker_allocation_in(req)
    components = []
    for i, c in enumerate(req.components):
        where = f"components[{i}]"
        buffers = tuple(
            LayerBuffer(b.layer_id, enum_in(BufferRole, b.role, f"{where}.layer_buffers[{j}].role"),
                            _memory_in(b.memory), b.length, b.item_len)
            for j, b in enumerate(c.layer_buffers)
        )
        components.append(ComponentSpec(enum_in(Component, c.component, f"{where}.component"),
                                        enum_in(Layout, c.layout, f"{where}.layout"), c.num_pages, buffers))
    return EngineSpec(req.engine_id, topology_in(req.topology), tuple(components), allocation)


def component_spec_out(c: ComponentSpec) -> pb.ComponentSpec:
    return pb.ComponentSpec(
        component=int(c.kind), layout=int(c.layout), num_pages=c.num_pages,
        layer_buffers=[pb.LayerBuffer(layer_id=b.layer_id, role=int(b.role), memory=_memory_out(b.memory),
                                      length=b.length, item_len=b.item_len) for b in c.layer_buffers],
    )


def components_in(values, field_name: str = "components") -> tuple[Component, ...]:
    return tuple(enum_in(Component, v, f"{field_name}[{i}]") for i, v in enumerate(values))


def status_out(s: TransferStatus) -> bpb.TransferStatus:
    return bpb.TransferStatus(
        request_id=s.request_id, engine_id=s.engine_id, role=int(s.role), state=int(s.state), code=s.code,
        reason=s.reason, pages=s.pages, runs=s.runs, bytes=s.bytes, truncated_pages=s.truncated_pages,
        duration_us=s.duration_us, components=[int(c) for c in s.components], parts=s.parts, aux=s.aux,
    )


def engine_layout_out(layout: EngineLayout) -> ppb.PeerEngine:
    return ppb.PeerEngine(
        engine_id=layout.engine_id, topology=topology_out(layout.topology),
        components=[
            ppb.PeerComponent(
                component=int(c.kind), layout=int(c.layout), num_pages=c.num_pages,
                layer_buffers=[ppb.PeerLayerBuffer(layer_id=b.layer_id, role=int(b.role), address=b.address,
                                                   length=b.length, item_len=b.item_len, device=b.device,
                                                   memory_kind=int(b.memory_kind))
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


def grant_pages_out(granted: dict[Component, np.ndarray]) -> list[pb.ComponentPages]:
    return [pb.ComponentPages(component=int(k), page_ids=v.tolist()) for k, v in granted.items()]


def part_pages_in(values, field_name: str = "pages") -> list[tuple[Component, np.ndarray, int]]:
    """PartPages messages: (component, source page ids, dst_offset) in request order."""
    return [(enum_in(Component, p.component, f"{field_name}[{i}].component"), page_ids_in(p.src_page_ids),
             p.dst_offset) for i, p in enumerate(values)]


def grant_offer_out(offer: GrantOffer, broker_id: str, epoch: int) -> ppb.OfferGrantRequest:
    return ppb.OfferGrantRequest(
        broker_id=broker_id, epoch=epoch, peer_address=offer.peer_address, engine_id=offer.engine_id,
        request_id=offer.request_id, sender_engine_id=offer.sender_engine_id,
        pages=grant_pages_out(offer.granted), remaining_ms=max(1, int(offer.remaining_s * 1000)),
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
    granted = check_grant_pages(None, grant_pages_in(req.pages), "pages", max_pages)
    return GrantOffer(req.peer_address, req.engine_id, req.request_id, req.sender_engine_id, granted,
                      req.remaining_ms / 1000, req.offer_token, req.generation)


def part_notice_out(n: PartNotice) -> ppb.PartNotice:
    return ppb.PartNotice(
        engine_id=n.engine_id, request_id=n.request_id, offer_token=n.token, part=n.part,
        parts_total=n.parts_total, succeeded=n.succeeded, code=n.code, reason=n.reason[:1024],
        landed=[ppb.PartLanded(component=int(x.kind), dst_offset=x.dst_offset, pages=x.pages) for x in n.landed],
        aux=n.aux,
    )


def part_notice_in(n: ppb.PartNotice, field_name: str) -> PartNotice:
    landed = tuple(Landed(enum_in(Component, x.component, f"{field_name}.landed[{j}].component"), x.dst_offset,
                          x.pages) for j, x in enumerate(n.landed))
    return PartNotice(n.engine_id, n.request_id, n.offer_token, n.part, n.parts_total, n.succeeded, landed,
                      n.aux, n.code, n.reason)


def part_ack_out(ack: PartAck) -> ppb.PartAck:
    return ppb.PartAck(state=0 if ack.state is None else int(ack.state), code=ack.code, reason=ack.reason)


def part_ack_in(ack: ppb.PartAck, address: str) -> PartAck:
    try:
        state = None if ack.state == 0 else TransferState(ack.state)
    except ValueError:
        raise BrokerError(Code.ABORTED, f"peer broker {address}: receiver reports unknown state {ack.state}") from None
    return PartAck(state, ack.code, ack.reason)
