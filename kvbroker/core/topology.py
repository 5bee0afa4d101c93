"""The topology and layout rules of DESIGN.md, one function per rule, each naming itself.

Called by the registry (`reject_index_with_value` at registration) and by the sender before any
byte moves: `check_transfer` for the two engines, `truncate_page_lists` for a request moved as
one list (the claimed flow), `part_pages` for one component of one part of an offered grant.
Nothing here knows about gRPC or a backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvbroker.core.errors import BrokerError, Code, precondition
from kvbroker.core.model import Component, ComponentLayout, EngineLayout, Topology


def reject_index_with_value(kind: Component) -> None:
    """Rule index-with-value: the MiniMax index with value is not supported, as upstream."""
    if kind is Component.MINIMAX_INDEX_KV:
        raise BrokerError(
            Code.UNIMPLEMENTED,
            "rule index-with-value: component MINIMAX_INDEX_KV (sparse index with value) is not "
            "supported; register MINIMAX_INDEX_K",
        )


# The MiniMax states and how their rules name them: upstream applies the same PP and attention-TP
# refusals to both (mooncake/conn.py, SGLang 0.5.23).
MINIMAX_STATES = {
    Component.MINIMAX_INDEX_K: ("index-k", "MiniMax sparse index"),
    Component.MINIMAX_DENSE_KV: ("dense-kv", "MiniMax dense KV"),
}


def check_no_pipeline_parallel(kind: Component, src: Topology, dst: Topology) -> None:
    """Rules index-k-pp and dense-kv-pp: the MiniMax states move only between engines with pp_size 1."""
    if kind not in MINIMAX_STATES:
        return
    slug, label = MINIMAX_STATES[kind]
    for side, topo in (("sender", src), ("receiver", dst)):
        if topo.pp_size > 1:
            raise precondition(f"rule {slug}-pp: PP>1 not supported for {label} ({side} pp_size={topo.pp_size})")


def check_homogeneous_attention_tp(kind: Component, src: Topology, dst: Topology) -> None:
    """Rules index-k-attn-tp and dense-kv-attn-tp: the MiniMax states need equal attention TP on both sides."""
    if kind in MINIMAX_STATES and src.attn_tp_size != dst.attn_tp_size:
        slug, label = MINIMAX_STATES[kind]
        raise precondition(
            f"rule {slug}-attn-tp: heterogeneous TP not supported for {label} "
            f"(sender attn_tp_size={src.attn_tp_size}, receiver attn_tp_size={dst.attn_tp_size})"
        )


def check_same_cache_shape(src: Topology, dst: Topology) -> None:
    """Rule same-shape: page size and kv dtype must match."""
    if src.page_size != dst.page_size:
        raise precondition(
            f"rule same-shape: page_size differs (sender {src.page_size}, receiver {dst.page_size})"
        )
    if src.kv_dtype != dst.kv_dtype:
        raise precondition(
            f"rule same-shape: kv_dtype differs (sender {src.kv_dtype.name}, receiver {dst.kv_dtype.name})"
        )


def check_same_component_layout(src: ComponentLayout, dst: ComponentLayout) -> None:
    """Rule same-layout: layout, layer ids and item_len of every layer buffer must match."""
    name = src.kind.name
    if src.layout != dst.layout:
        raise precondition(
            f"rule same-layout: {name} layout differs (sender {src.layout.name}, receiver {dst.layout.name})"
        )
    if src.buffer_keys != dst.buffer_keys:
        src_layers = sorted({layer for layer, _ in src.buffer_keys})
        dst_layers = sorted({layer for layer, _ in dst.buffer_keys})
        raise precondition(
            f"rule same-layout: {name} layer ids differ (sender {src_layers}, receiver {dst_layers})"
        )
    for s, d in zip(src.buffers, dst.buffers):
        if s.item_len != d.item_len:
            raise precondition(
                f"rule same-layout: {name} layer {s.layer_id} {s.role.name} item_len differs "
                f"(sender {s.item_len}, receiver {d.item_len})"
            )


def check_transfer(src: EngineLayout, dst: EngineLayout, components: Iterable[Component]) -> None:
    """Every rule that decides whether `components` may move from `src` to `dst`; the first broken one raises."""
    check_same_cache_shape(src.topology, dst.topology)
    for kind in components:
        for engine, side in ((src, "sender"), (dst, "receiver")):
            if kind not in engine.components:
                raise precondition(f"component {kind.name} is not registered by {side} engine {engine.engine_id!r}")
        check_no_pipeline_parallel(kind, src.topology, dst.topology)
        check_homogeneous_attention_tp(kind, src.topology, dst.topology)
        check_same_component_layout(src.components[kind], dst.components[kind])


def truncate_page_lists(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rule truncate: page lists of unequal length are cut to the shorter. The destination entries
    left are the request's truncated_pages; source pages past the destination list are not counted."""
    n = min(len(src), len(dst))
    return src[:n], dst[:n]


@dataclass(frozen=True)
class PartLanding:
    """Where one component's source pages of a part land: `src[i]` is written to `dst[i]`, which
    are entries [dst_offset, dst_offset + len(dst)) of the grant's page list of that component."""

    src: np.ndarray
    dst: np.ndarray
    dst_offset: int


def check_dense_kv(granted: np.ndarray, src: np.ndarray | None, dst_offset: int, *, last: bool) -> None:
    """Rule dense-kv-length: MINIMAX_DENSE_KV moves whole, with the last part only (SGLang 0.5.23
    sends it there, and treats lists of unequal length as an error): a part with more_parts may not
    carry it, and the last part must carry the grant's whole list, from entry 0, one source page per
    entry. `src` None: the part does not carry it."""
    if src is None:
        if last:
            raise precondition(f"rule dense-kv-length: the last part leaves MINIMAX_DENSE_KV with none of its "
                               f"{len(granted)} granted pages sent; it moves whole, with the last part")
        return
    if not last:
        raise precondition("rule dense-kv-length: MINIMAX_DENSE_KV moves whole, with the last part only; "
                           "this part has more_parts")
    if dst_offset != 0 or len(src) != len(granted):
        raise precondition(
            f"rule dense-kv-length: MINIMAX_DENSE_KV page lists must be of equal length (sender {len(src)} "
            f"from dst_offset {dst_offset}, receiver {len(granted)})"
        )


def part_pages(kind: Component, src: np.ndarray, granted: np.ndarray, dst_offset: int, *, last: bool,
               src_offset: int = 0) -> PartLanding:
    """The page rule of `kind` for one part that starts at entry `dst_offset` of the grant's list.

    Rule src-offset: the grant's first entry takes the sender's page at `src_offset` of its sequence
    (the receiver holds the pages before it): a part's pages before that position are not written,
    and its `dst_offset` counts from the sender's first page, so it lands `src_offset` entries earlier.
    Rule part-in-grant: the part must start inside the grant's list (PERMISSION_DENIED).
    Rule dense-kv-length (check_dense_kv): MINIMAX_DENSE_KV moves whole, with the last part only.
    Rule index-k-truncate: MINIMAX_INDEX_K is cut to the shorter of the source list and the rest of
    the grant's list (upstream's truncation), and the count is reported.
    Rule chunk: any other component lands on the next len(src) entries; source pages past the end of
    the grant's list are dropped and counted, as upstream drops them.
    """
    if src_offset:
        skipped = min(len(src), max(0, src_offset - dst_offset))
        src, dst_offset = src[skipped:], max(0, dst_offset - src_offset)
    if dst_offset > len(granted) or (dst_offset == len(granted) and len(src)):
        raise BrokerError(Code.PERMISSION_DENIED,
                          f"rule part-in-grant: {kind.name} dst_offset {dst_offset} is past the end of the "
                          f"grant's {len(granted)} pages")
    rest = granted[dst_offset:]
    if kind is Component.MINIMAX_DENSE_KV:
        check_dense_kv(granted, src, dst_offset, last=last)
        return PartLanding(src, rest, dst_offset)
    if kind is Component.MINIMAX_INDEX_K:
        cut_src, cut_dst = truncate_page_lists(src, rest)
        return PartLanding(cut_src, cut_dst, dst_offset)
    n = min(len(src), len(rest))
    return PartLanding(src[:n], rest[:n], dst_offset)
