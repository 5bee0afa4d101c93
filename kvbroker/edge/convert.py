"""Translation between the kvbroker.v1 messages and the domain's dataclasses, for the servicers.

- into the domain: `engine_spec_in` (RegisterEngine), `components_in`, `part_pages_in`;
- out of it: `status_out`, `component_spec_out`, `memory_ownership_out` (service.py);
- the peer plane's messages (Handshake, OfferGrant, NotifyParts) both ways, and the pieces both
  planes share (`enum_in`, `page_ids_in`, `topology_in`/`_out`, `grant_pages_in`/`_out`), are
  kvbroker.peers.wire's, re-exported here for the servicers: the peer clients use them too.
Unknown enum values and missing fields become INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import numpy as np

from kvbroker.core.errors import invalid
from kvbroker.core.model import (
    BrokerAllocation,
    BufferRole,
    Component,
    ComponentSpec,
    CudaIpcRef,
    EngineSpec,
    LayerBuffer,
    Layout,
    SharedMemoryRef,
)
from kvbroker.flows.part_sender import PartCommand
from kvbroker.flows.receiver import GrantCommand
from kvbroker.flows.sender import TransferCommand
from kvbroker.flows.transfers import TransferStatus
from kvbroker.peers.wire import (  # noqa: F401  re-exported for the servicers
    engine_layout_in,
    engine_layout_out,
    enum_in,
    enum_out,
    grant_offer_in,
    grant_offer_out,
    grant_pages_in,
    grant_pages_out,
    page_ids_in,
    part_ack_in,
    part_ack_out,
    part_notice_in,
    part_notice_out,
    src_offsets_in,
    topology_in,
    topology_out,
)
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb


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


def memory_ownership_out(spec: EngineSpec) -> bpb.MemoryOwnership:
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
        component=enum_out(c.kind, pb.Component), layout=enum_out(c.layout, pb.Layout), num_pages=c.num_pages,
        layer_buffers=[pb.LayerBuffer(layer_id=b.layer_id, role=enum_out(b.role, pb.BufferRole),
                                      memory=_memory_out(b.memory), length=b.length, item_len=b.item_len)
                       for b in c.layer_buffers],
    )


def components_in(values, field_name: str = "components") -> tuple[Component, ...]:
    return tuple(enum_in(Component, v, f"{field_name}[{i}]") for i, v in enumerate(values))


def status_out(s: TransferStatus) -> bpb.TransferStatus:
    return bpb.TransferStatus(
        request_id=s.request_id, engine_id=s.engine_id, role=enum_out(s.role, pb.TransferRole),
        state=enum_out(s.state, pb.TransferState), code=s.code, reason=s.reason, pages=s.pages, runs=s.runs,
        bytes=s.bytes, truncated_pages=s.truncated_pages, duration_us=s.duration_us,
        components=[enum_out(c, pb.Component) for c in s.components], parts=s.parts, aux=s.aux,
    )


def grant_command_in(request: bpb.ExpectTransferRequest) -> GrantCommand:
    """An ExpectTransfer as the domain's command: a page list per component (`pages`), or one list
    shared by `components` (the claimed flow's form)."""
    if request.pages and (request.components or request.dst_page_ids):
        raise invalid("pages: give either pages, or components with dst_page_ids, not both")
    if request.pages:
        pages, shared = grant_pages_in(request.pages), False
        offsets = tuple(src_offsets_in(request.pages))
    else:
        ids = page_ids_in(request.dst_page_ids)
        pages, shared, offsets = [(kind, ids) for kind in components_in(request.components)], True, ()
    return GrantCommand(request.request_id, request.engine_id, tuple(pages), request.expiry_ms,
                        request.sender_address, request.sender_engine_id, shared, offsets)


def transfer_command_in(request: bpb.TransferRequest) -> TransferCommand | PartCommand:
    """A Transfer as the domain's command: the claimed flow's when it names the receiver
    (peer_address), else one part of the offered flow."""
    if request.peer_address or request.remote_engine_id:
        if request.pages or request.more_parts or request.aux or request.receiver_broker_id:
            raise invalid("pages: the claimed flow (peer_address set) takes components and src_page_ids; "
                          "pages, more_parts, aux and receiver_broker_id belong to the offered flow "
                          "(peer_address empty)")
        return TransferCommand(
            request.request_id, request.engine_id, request.peer_address, request.remote_engine_id,
            components_in(request.components), page_ids_in(request.src_page_ids),
            page_ids_in(request.dst_page_ids),
        )
    if request.dst_page_ids:
        raise invalid("dst_page_ids: the offered flow places pages by PartPages.dst_offset")
    if request.pages and (request.components or request.src_page_ids):
        raise invalid("pages: give either pages, or components with src_page_ids, not both")
    if request.pages:
        pages = part_pages_in(request.pages)
    else:
        ids = page_ids_in(request.src_page_ids)
        pages = [(kind, ids, 0) for kind in components_in(request.components)]
    return PartCommand(request.request_id, request.engine_id, tuple(pages), not request.more_parts, request.aux,
                       request.receiver_broker_id)


def part_pages_in(values, field_name: str = "pages") -> list[tuple[Component, np.ndarray, int]]:
    """PartPages messages: (component, source page ids, dst_offset) in request order."""
    return [(enum_in(Component, p.component, f"{field_name}[{i}].component"), page_ids_in(p.src_page_ids),
             p.dst_offset) for i, p in enumerate(values)]
