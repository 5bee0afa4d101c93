"""The topology and layout rules of DESIGN.md, one function per rule, each naming itself.

Called by the registry (`reject_index_with_value` at registration) and by the sender before any
byte moves (`check_transfer`, `truncate_page_lists`). Nothing here knows about gRPC or a backend.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvbroker.errors import BrokerError, Code, precondition
from kvbroker.model import Component, ComponentLayout, EngineLayout, Topology


def reject_index_with_value(kind: Component) -> None:
    """Rule index-with-value: the MiniMax index with value is not supported, as upstream."""
    if kind is Component.MINIMAX_INDEX_KV:
        raise BrokerError(
            Code.UNIMPLEMENTED,
            "rule index-with-value: component MINIMAX_INDEX_KV (sparse index with value) is not "
            "supported; register MINIMAX_INDEX_K",
        )


def check_no_pipeline_parallel(kind: Component, src: Topology, dst: Topology) -> None:
    """Rule index-k-pp: the MiniMax sparse index moves only between engines with pp_size 1."""
    if kind is not Component.MINIMAX_INDEX_K:
        return
    for side, topo in (("sender", src), ("receiver", dst)):
        if topo.pp_size > 1:
            raise precondition(
                f"rule index-k-pp: PP>1 not supported for MiniMax sparse index "
                f"({side} pp_size={topo.pp_size})"
            )


def check_homogeneous_attention_tp(kind: Component, src: Topology, dst: Topology) -> None:
    """Rule index-k-attn-tp: the MiniMax sparse index needs equal attention TP on both sides."""
    if kind is Component.MINIMAX_INDEX_K and src.attn_tp_size != dst.attn_tp_size:
        raise precondition(
            f"rule index-k-attn-tp: heterogeneous TP not supported for MiniMax sparse index "
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


def check_transfer(src: EngineLayout, dst: EngineLayout, kinds: Iterable[Component]) -> None:
    """Every rule that decides whether `kinds` may move from `src` to `dst`; the first broken one raises."""
    check_same_cache_shape(src.topology, dst.topology)
    for kind in kinds:
        for engine, side in ((src, "sender"), (dst, "receiver")):
            if kind not in engine.components:
                raise precondition(f"component {kind.name} is not registered by {side} engine {engine.engine_id!r}")
        check_no_pipeline_parallel(kind, src.topology, dst.topology)
        check_homogeneous_attention_tp(kind, src.topology, dst.topology)
        check_same_component_layout(src.components[kind], dst.components[kind])


def truncate_page_lists(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Rule truncate: page lists of unequal length are cut to the shorter; returns the dropped count."""
    n = min(len(src), len(dst))
    return src[:n], dst[:n], max(len(src), len(dst)) - n
