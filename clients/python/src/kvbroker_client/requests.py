"""The BrokerService requests BrokerClient sends, built from Python arguments and checked as the
broker would name them (InvalidArgument naming the argument): page ids, components, topologies.

- `register_request`, `grant_request` (ExpectTransfer, either flow), `part_request` (a part of the
  offered flow), `claimed_request` (the claimed flow's Transfer), `watch_request`, `cancel_request`;
- `page_ids`: a page-id list from any 1-D integer sequence (numpy arrays included);
- `grant_pages_of_old`, `part_pages_of_old`: the deprecated argument forms, warned and mapped.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvbroker_client.errors import InvalidArgument
from kvbroker_client.model import Component, ComponentSpec, Topology
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb

ComponentLike = Component | int | str
PageIds = Sequence[int] | np.ndarray
OWNERSHIP = {"server": bpb.MEMORY_OWNERSHIP_SERVER, "broker": bpb.MEMORY_OWNERSHIP_BROKER}


def page_ids(ids: PageIds, field_name: str) -> list[int]:
    array = np.asarray(ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidArgument(f"{field_name}: expected a 1-D sequence of integer page ids")
    if array.size and (array.min() < 0 or array.max() >= 1 << 32):
        bad = int(np.flatnonzero((array < 0) | (array >= 1 << 32))[0])
        raise InvalidArgument(f"{field_name}[{bad}]: page id {int(array[bad])} is outside [0, 2**32)")
    return array.astype(np.int64).tolist()


def components_of(components: Iterable[ComponentLike]) -> list[pb.Component]:
    return [Component.of(c).value for c in components]


def milliseconds(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def register_request(engine_id: str, topology: Topology | pb.Topology,
                     components: Sequence[ComponentSpec | pb.ComponentSpec], memory_ownership: str,
                     allocation_device: int) -> bpb.RegisterEngineRequest:
    if memory_ownership not in OWNERSHIP:
        raise InvalidArgument(f"memory_ownership: {memory_ownership!r} is not one of {sorted(OWNERSHIP)}")
    return bpb.RegisterEngineRequest(
        engine_id=engine_id, topology=topology.to_proto() if isinstance(topology, Topology) else topology,
        components=[c.to_proto() if isinstance(c, ComponentSpec) else c for c in components],
        memory_ownership=OWNERSHIP[memory_ownership], allocation_device=allocation_device)


def grant_request(engine_id: str, request_id: str, dst_pages: Mapping[ComponentLike, PageIds] | None, *,
                  dst_page_ids: PageIds, components: Iterable[ComponentLike],
                  src_offsets: Mapping[ComponentLike, int] | None, sender_address: str, sender_engine_id: str,
                  expiry_s: float | None) -> bpb.ExpectTransferRequest:
    """An ExpectTransfer: a page list per component (`dst_pages`, the offered flow), or one list
    for all of `components` (`dst_page_ids`, the claimed flow)."""
    request = bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=engine_id, sender_address=sender_address,
        sender_engine_id=sender_engine_id, expiry_ms=0 if expiry_s is None else max(1, round(expiry_s * 1000)),
    )
    if dst_pages is not None:
        if len(dst_page_ids):
            raise InvalidArgument("dst_page_ids: give either dst_page_ids or dst_pages, not both")
        offsets = {Component.of(c): int(o) for c, o in (src_offsets or {}).items()}
        if stray := sorted(c.name for c in set(offsets) - {Component.of(c) for c in dst_pages}):
            raise InvalidArgument(f"src_offsets: {', '.join(stray)} not in dst_pages")
        request.pages.extend(pb.ComponentPages(component=Component.of(c).value,
                                               page_ids=page_ids(ids, f"dst_pages[{Component.of(c).name}]"),
                                               src_offset=offsets.get(Component.of(c), 0))
                             for c, ids in dst_pages.items())
    else:
        if src_offsets:
            raise InvalidArgument("src_offsets: for a grant with a page list per component (dst_pages)")
        request.components.extend(components_of(components))
        request.dst_page_ids.extend(page_ids(dst_page_ids, "dst_page_ids"))
    return request


def part_request(engine_id: str, request_id: str, src_pages: Mapping[ComponentLike, PageIds], *, last: bool,
                 dst_offsets: Mapping[ComponentLike, int] | None, aux: bytes,
                 receiver_broker_id: str, end_watches: bool | None = None) -> bpb.TransferRequest:
    """One part of the offered flow: source pages per component, each landing from its dst_offset."""
    offsets = {Component.of(c): int(o) for c, o in (dst_offsets or {}).items()}
    if stray := sorted(c.name for c in set(offsets) - {Component.of(c) for c in src_pages}):
        raise InvalidArgument(f"dst_offsets: {', '.join(stray)} not in src_pages")
    return bpb.TransferRequest(
        request_id=request_id, engine_id=engine_id, more_parts=not last, aux=bytes(aux),
        receiver_broker_id=receiver_broker_id, end_watches=last if end_watches is None else end_watches,
        pages=[bpb.PartPages(component=Component.of(c).value,
                             src_page_ids=page_ids(ids, f"src_pages[{Component.of(c).name}]"),
                             dst_offset=offsets.get(Component.of(c), 0))
               for c, ids in src_pages.items()],
    )


def claimed_request(engine_id: str, request_id: str, peer_address: str, remote_engine_id: str,
                    src_page_ids: PageIds, dst_page_ids: PageIds,
                    components: Iterable[ComponentLike]) -> bpb.TransferRequest:
    """The claimed flow's Transfer: the sender names the receiver's broker and engine."""
    return bpb.TransferRequest(
        request_id=request_id, engine_id=engine_id, peer_address=peer_address,
        remote_engine_id=remote_engine_id, components=components_of(components),
        src_page_ids=page_ids(src_page_ids, "src_page_ids"), dst_page_ids=page_ids(dst_page_ids, "dst_page_ids"),
    )


def watch_request(engine_id: str, request_id: str, *, states_only: bool, terminal_only: bool,
                  offer_wait_s: float) -> bpb.WatchTransferRequest:
    return bpb.WatchTransferRequest(engine_id=engine_id, request_id=request_id, states_only=states_only,
                                    terminal_only=terminal_only, offer_wait_ms=milliseconds(offer_wait_s))


def cancel_request(engine_id: str, request_id: str, reason: str, offer_wait_s: float) -> bpb.CancelTransferRequest:
    return bpb.CancelTransferRequest(engine_id=engine_id, request_id=request_id, reason=reason,
                                     offer_wait_ms=milliseconds(offer_wait_s))


def _deprecated(old: str, new: str) -> None:
    # stacklevel: warn <- _deprecated <- *_of_old <- the BrokerClient method <- its caller
    warnings.warn(f"kvbroker_client: {old} is deprecated; use {new} (the old form goes in the next release)",
                  DeprecationWarning, stacklevel=4)


def grant_pages_of_old(dst_pages, dst_page_ids: PageIds, pages: Mapping[ComponentLike, PageIds] | None):
    """expect_transfer's page arguments with the deprecated forms mapped: `pages=` (now `dst_pages=`) and a
    page list as the third positional argument (now `dst_page_ids=`); each warns."""
    if pages is not None:
        _deprecated("expect_transfer(pages=...)", "dst_pages=...")
        if dst_pages is not None:
            raise InvalidArgument("pages: give dst_pages (pages is its old name), not both")
        dst_pages = pages
    if dst_pages is not None and not isinstance(dst_pages, Mapping):
        _deprecated("expect_transfer(engine_id, request_id, page_ids)", "dst_page_ids=page_ids")
        if len(dst_page_ids):
            raise InvalidArgument("dst_page_ids: given twice (positionally and by name)")
        dst_pages, dst_page_ids = None, dst_pages
    return dst_pages, dst_page_ids


def part_pages_of_old(src_pages: Mapping[ComponentLike, PageIds] | None, last: bool | None,
                      pages: Mapping[ComponentLike, PageIds] | None) -> tuple[Mapping[ComponentLike, PageIds], bool]:
    """transfer_part's arguments with the deprecated forms mapped: `pages=` (now `src_pages=`) and no
    `last` (it meant last=True); each warns."""
    if pages is not None:
        _deprecated("transfer_part(pages=...)", "src_pages=...")
        if src_pages is not None:
            raise InvalidArgument("pages: give src_pages (pages is its old name), not both")
        src_pages = pages
    if src_pages is None:
        raise InvalidArgument("src_pages: the part's source page ids per component are required")
    if last is None:
        _deprecated("transfer_part() without last", "last=True or last=False")
        last = True
    return src_pages, last
