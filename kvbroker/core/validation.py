"""Validation of one request, before any state changes: pure functions that raise BrokerError
naming the field and the rule.

- `check_identifier`: engine ids, request ids (RegisterEngine, ExpectTransfer, Transfer);
- `validate_topology`, `validate_spec`: a declared engine, without touching memory (Registry.check);
- `check_components`: a request's component list (ExpectTransfer, Transfer);
- `registered_pages`: each of a request's components is registered by the engine, and the pages
  they all have, the bound of a page id into them (ExpectTransfer, Transfer, and the sender's plan
  against the receiver's engine);
- `check_page_ids`: a page-id list against that bound and the request limit;
- `check_grant_pages`, `check_part_pages`: a page list per component, for a grant (ExpectTransfer,
  an offer received) and for one part of an offered transfer (Transfer);
- `check_aux`, `check_peer_address`: the aux payload's bound; a peer broker's address.

Callers: Registry (registry.py), Broker (broker.py), the sender's plan.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from kvbroker.core import topology
from kvbroker.core.errors import BrokerError, Code, invalid, precondition
from kvbroker.core.model import (
    BufferRole,
    Component,
    CudaIpcRef,
    EngineLayout,
    EngineSpec,
    Layout,
    MemoryKind,
    Region,
    SharedMemoryRef,
    Topology,
)

IDENTIFIER = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
OFFER_TOKEN = re.compile(r"[0-9a-f]{32}")
ROLES_BY_LAYOUT = {Layout.FLAT: (BufferRole.FLAT,), Layout.KV_SPLIT: (BufferRole.K, BufferRole.V)}


MAX_DEVICE_ORDINAL = 255  # plausibility bound checked before any driver is asked
IPC_HANDLE_SIZE = 64  # sizeof(CUipcMemHandle) == sizeof(cudaIpcMemHandle_t)


def check_identifier(value: str, field_name: str) -> None:
    if not IDENTIFIER.fullmatch(value):
        raise invalid(f"{field_name}: {value!r} must match [A-Za-z0-9._:/-]{{1,128}}")


def validate_topology(t: Topology) -> None:
    for name in ("tp_size", "attn_tp_size", "pp_size", "page_size"):
        if getattr(t, name) < 1:
            raise invalid(f"topology.{name}: must be at least 1, got {getattr(t, name)}")
    for rank, size in (("tp_rank", "tp_size"), ("attn_tp_rank", "attn_tp_size"), ("pp_rank", "pp_size")):
        if getattr(t, rank) >= getattr(t, size):
            raise invalid(f"topology.{rank}: must be below {size}={getattr(t, size)}, got {getattr(t, rank)}")
    if t.end_layer <= t.start_layer:
        raise invalid(f"topology.end_layer: must exceed start_layer={t.start_layer}, got {t.end_layer}")


def validate_spec(spec: EngineSpec, max_pages: int) -> None:
    """Everything about a declared engine that can be checked without mapping memory."""
    check_identifier(spec.engine_id, "engine_id")
    validate_topology(spec.topology)
    if not spec.components:
        raise invalid("components: at least one component is required")
    if spec.broker_allocation is not None and spec.broker_allocation.device > MAX_DEVICE_ORDINAL:
        raise invalid(f"allocation_device: {spec.broker_allocation.device} is not a plausible CUDA device ordinal "
                      f"(at most {MAX_DEVICE_ORDINAL})")
    first_kind: tuple[str, type] | None = None  # where the engine's first memory reference is, and its kind
    seen: set[Component] = set()
    for i, comp in enumerate(spec.components):
        where = f"components[{i}]"
        topology.reject_index_with_value(comp.kind)
        if comp.kind in seen:
            raise invalid(f"{where}.component: {comp.kind.name} is registered twice")
        seen.add(comp.kind)
        if comp.kind is Component.MINIMAX_INDEX_K and comp.layout is not Layout.FLAT:
            raise invalid(f"{where}.layout: MINIMAX_INDEX_K must be LAYOUT_FLAT, got {comp.layout.name}")
        if comp.kind is Component.MINIMAX_DENSE_KV and comp.layout is not Layout.KV_SPLIT:
            raise invalid(f"{where}.layout: MINIMAX_DENSE_KV (K and V per dense layer) must be LAYOUT_KV_SPLIT, got "
                          f"{comp.layout.name}")
        if not 1 <= comp.num_pages <= max_pages:
            raise invalid(f"{where}.num_pages: must be in [1, {max_pages}], got {comp.num_pages}")
        if not comp.layer_buffers:
            raise invalid(f"{where}.layer_buffers: at least one layer buffer is required")
        roles = ROLES_BY_LAYOUT[comp.layout]
        keys: set[tuple[int, BufferRole]] = set()
        for j, buf in enumerate(comp.layer_buffers):
            at = f"{where}.layer_buffers[{j}] (layer {buf.layer_id}, {buf.role.name})"
            if buf.role not in roles:
                raise invalid(f"{at}.role: {comp.layout.name} layout takes {'/'.join(r.name for r in roles)}")
            if (buf.layer_id, buf.role) in keys:
                raise invalid(f"{at}: layer {buf.layer_id} {buf.role.name} is declared twice")
            keys.add((buf.layer_id, buf.role))
            if not spec.topology.start_layer <= buf.layer_id < spec.topology.end_layer:
                raise invalid(
                    f"{at}.layer_id: outside the engine's layers "
                    f"[{spec.topology.start_layer}, {spec.topology.end_layer})"
                )
            if buf.item_len == 0:
                raise invalid(f"{at}.item_len: must be greater than zero")
            if buf.length < comp.num_pages * buf.item_len:
                raise invalid(
                    f"{at}.length: {buf.length} bytes is shorter than num_pages × item_len = "
                    f"{comp.num_pages} × {buf.item_len} = {comp.num_pages * buf.item_len}"
                )
            if spec.broker_allocation is not None:
                if buf.memory is not None:
                    raise invalid(f"{at}.memory: must be unset with MEMORY_OWNERSHIP_BROKER; the broker "
                                  "allocates it")
                continue
            if buf.memory is None:
                raise invalid(f"{at}.memory: a memory reference is required")
            if first_kind is None:
                first_kind = (at, type(buf.memory))
            elif type(buf.memory) is not first_kind[1]:
                raise invalid(f"{at}.memory: {_ONEOF[type(buf.memory)]}, but {first_kind[0]} is "
                              f"{_ONEOF[first_kind[1]]}; an engine's layer buffers are all host memory or all GPU")
            if isinstance(buf.memory, CudaIpcRef):
                check_cuda_ref(buf.memory, buf.length, f"{at}.memory.cuda_ipc")
        if comp.layout is Layout.KV_SPLIT:
            layers = {layer for layer, _ in keys}
            for layer in sorted(layers):
                for role in roles:
                    if (layer, role) not in keys:
                        raise invalid(f"{where}.layer_buffers: layer {layer} has no {role.name} buffer")


_ONEOF = {SharedMemoryRef: "shared_memory", CudaIpcRef: "cuda_ipc"}



def check_page_ids(ids: np.ndarray, field_name: str, num_pages: int, max_pages: int, *, unique: bool) -> None:
    if ids.size == 0:
        raise invalid(f"{field_name}: at least one page id is required")
    if ids.size > max_pages:
        raise BrokerError(Code.RESOURCE_EXHAUSTED,
                          f"{field_name}: {ids.size} page ids exceed the limit of {max_pages} per request")
    over = np.flatnonzero(ids >= num_pages)
    if over.size:
        i = int(over[0])
        raise invalid(f"{field_name}[{i}]: page id {int(ids[i])} is out of range [0, {num_pages})")
    if unique:
        check_unique(ids, field_name)


def check_unique(ids: np.ndarray, field_name: str, rule: str = "") -> None:
    """Each page id of `ids` once (INVALID_ARGUMENT naming the first repeated id, and `rule` if given)."""
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        dup = int(uniq[counts > 1][0])
        raise invalid(f"{field_name}: page id {dup} appears more than once" + (f" ({rule})" if rule else ""))


def check_components(components: Sequence[Component], field_name: str, *,
                     allow_empty: bool = False) -> tuple[Component, ...]:
    if not components and not allow_empty:
        raise invalid(f"{field_name}: at least one component is required")
    if len(set(components)) != len(components):
        raise invalid(f"{field_name}: a component is listed twice")
    for kind in components:
        topology.reject_index_with_value(kind)
    return tuple(components)


def registered_pages(layout: EngineLayout, components: Sequence[Component]) -> int:
    """The pages every one of `components` has on the engine: a page id into them is below this.
    A component the engine did not register is FAILED_PRECONDITION."""
    for kind in components:
        if kind not in layout.components:
            raise precondition(f"components: {kind.name} is not registered by engine {layout.engine_id!r}")
    return min(layout.components[k].num_pages for k in components)


def check_grant_pages(layout: EngineLayout | None, pages: Sequence[tuple[Component, np.ndarray]], field_name: str,
                      max_pages: int) -> dict[Component, np.ndarray]:
    """A grant's destination pages per component: each component once, registered by the engine
    (`layout`; None: the receiver's, not known here, so only the request bound applies), each list
    non-empty, without duplicates and inside that component's pages."""
    components = check_components([kind for kind, _ in pages], field_name)
    granted = {}
    for i, (kind, ids) in enumerate(pages):
        num_pages = np.iinfo(np.int64).max if layout is None else registered_pages(layout, [kind])
        check_page_ids(ids, f"{field_name}[{i}].page_ids ({kind.name})", num_pages, max_pages, unique=True)
        granted[kind] = ids
    assert tuple(granted) == components
    return granted


def check_src_offsets(offsets: Sequence[tuple[Component, int]], granted: Mapping[Component, np.ndarray], *,
                      offered: bool, max_pages: int, field_name: str = "pages") -> dict[Component, int]:
    """A grant's src_offset per component (rule src-offset, topology.part_pages): only for a grant
    offered to its sender, only for components it grants, each at most `max_pages`; zeros dropped."""
    out = {}
    for kind, offset in offsets:
        where = f"{field_name}[{list(granted).index(kind) if kind in granted else '?'}].src_offset ({kind.name})"
        if not offset:
            continue
        if not offered:
            raise invalid(f"{where}: src_offset is for a grant offered to its sender (sender_address)")
        if kind not in granted:
            raise invalid(f"{where}: {kind.name} is not in the grant")
        if offset > max_pages:
            raise BrokerError(Code.RESOURCE_EXHAUSTED,
                              f"{where}: {offset} pages exceeds the limit of {max_pages} (max_pages_per_request)")
        out[kind] = int(offset)
    return out


def check_part_pages(layout: EngineLayout, pages: Sequence[tuple[Component, np.ndarray, int]], field_name: str,
                     max_pages: int) -> None:
    """One part's source pages per component: each component once and registered by the sending
    engine, each id inside its pages; a list may be empty (a part that moves only some components)."""
    check_components([kind for kind, _, _ in pages], field_name, allow_empty=True)
    for i, (kind, ids, _) in enumerate(pages):
        num_pages = registered_pages(layout, [kind])
        if ids.size:
            check_page_ids(ids, f"{field_name}[{i}].src_page_ids ({kind.name})", num_pages, max_pages, unique=False)


def check_aux(aux: bytes, *, last: bool, max_aux_bytes: int) -> None:
    if not aux:
        return
    if not last:
        raise invalid("aux: only the last part (more_parts false) carries the aux payload")
    if len(aux) > max_aux_bytes:
        raise BrokerError(Code.RESOURCE_EXHAUSTED,
                          f"aux: {len(aux)} bytes exceed the limit of {max_aux_bytes} (max_aux_bytes)")


PEER_ADDRESS = re.compile(r"(unix:[^\x00]{1,200}|\[[0-9A-Fa-f:.]{2,45}\]:\d{1,5}|[A-Za-z0-9._-]{1,253}:\d{1,5})")


def check_peer_address(value: str, field_name: str) -> None:
    """A peer broker's peer listener: "host:port", "[v6]:port" or "unix:/path"."""
    if not PEER_ADDRESS.fullmatch(value):
        raise invalid(f"{field_name}: {value[:128]!r} is not a peer address (host:port, [v6]:port or unix:/path)")


def check_cuda_ref(ref: CudaIpcRef, length: int, field_name: str) -> None:
    """Everything about a CUDA IPC reference that can be checked without a GPU; `field_name` ends in .cuda_ipc."""
    if len(ref.handle) != IPC_HANDLE_SIZE:
        hint = ""
        if len(ref.handle) == IPC_HANDLE_SIZE + 2 and ref.handle[1:2] == b"c":
            hint = ("; this looks like torch's storage handle (a version byte, 'c', then the handle): send "
                    "its last 64 bytes, as kvbroker_client.tensors does")
        raise invalid(f"{field_name}.handle: must be the {IPC_HANDLE_SIZE}-byte cudaIpcMemHandle_t, "
                      f"got {len(ref.handle)} bytes{hint}")
    if not any(ref.handle):
        raise invalid(f"{field_name}.handle: all {IPC_HANDLE_SIZE} bytes are zero, which no cudaIpcGetMemHandle "
                      "returns")
    if ref.device > MAX_DEVICE_ORDINAL:
        raise invalid(f"{field_name}.device: {ref.device} is not a plausible CUDA device ordinal "
                      f"(at most {MAX_DEVICE_ORDINAL})")
    if ref.allocation_size == 0:
        raise invalid(f"{field_name}.allocation_size: must be greater than zero")
    if ref.offset + length > ref.allocation_size:
        raise invalid(f"{field_name}: offset {ref.offset} + length {length} exceeds allocation_size "
                      f"{ref.allocation_size}")


def declared_regions(layout: EngineLayout, where: str = "handshake.engine") -> tuple[Region, ...]:
    """The layer buffers a peer's handshake declares, as regions, once each holds its pages: a
    buffer's num_pages pages of item_len bytes lie inside [address, address + length), which ends
    below 2**64 (INVALID_ARGUMENT otherwise). The planner writes to the peer only at those pages, so
    these regions bound every descriptor towards it; the backend checks them against the memory the
    peer's engine metadata registers (Backend.connect)."""
    regions = []
    for kind, component in layout.components.items():
        for b in component.buffers:
            pages = component.num_pages * b.item_len
            if b.address <= 0 or b.address + b.length > 1 << 64 or pages > b.length:
                raise invalid(f"{where}: the {kind.name} layer {b.layer_id} {b.role.name} buffer at {b.address:#x} "
                              f"of {b.length} bytes cannot hold its {component.num_pages} pages of {b.item_len} "
                              "bytes (rule declared-buffer)")
            regions.append(Region(b.address, b.length, b.device, gpu=b.memory_kind is MemoryKind.GPU))
    return tuple(regions)
