"""vLLM's KV caches as kvbroker components: the tables, no rules (those are the broker's).

vLLM 0.32 keeps each attention layer's cache as one tensor of `[blocks, ...]` (CPU: LBHNC, one
contiguous page per block of a layer, K and V inside it), so each layer is one FLAT layer buffer
whose page id is vLLM's block id and whose item length is the layer's page size:

    MAIN_KV           every attention layer's cache
    MINIMAX_INDEX_K   MiniMax-M3's index K caches (an MLA spec with the indexer's role), sharing the
                      main KV's block ids: one block table for both

    engine_components(kv_caches, specs, num_blocks, refs)   the components, layer buffers on `refs`
    engine_topology(components, specs, ...)     page size (block size), layers, dtype, ranks
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbroker_client import BufferRole, Component, ComponentSpec, KvDtype, LayerBuffer, Layout, Topology
from kvbroker_client.tensors import kv_dtype
from kvbroker_vllm.vllm_0_32 import is_index_k

RefsFn = Callable[[Sequence[int], Sequence[int], str], list]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LayoutError(ValueError):
    """KV caches kvbroker cannot describe; the message names the layer and what is wrong."""


def layer_id(name: str) -> int:
    """The global layer id in a vLLM layer name (`model.layers.7.self_attn.attn`)."""
    match = _LAYER.search(name)
    if match is None:
        raise LayoutError(f"KV cache layer {name!r}: no layer id in its name (model.layers.<id>....)")
    return int(match.group(1))


def component_of(spec) -> Component:
    return Component.MINIMAX_INDEX_K if is_index_k(spec) else Component.MAIN_KV


def _page(name: str, tensor, spec, num_blocks: int) -> tuple[int, int, int]:
    """(address, length, item length) of one layer's cache: its pages, vLLM block after block. A
    kernel that splits each block into `ratio` kernel blocks sees `ratio * num_blocks` rows; a block
    is then `ratio` consecutive rows, one page as long as they are dense."""
    if tensor.dim() < 2 or tensor.shape[0] % num_blocks:
        raise LayoutError(f"KV cache layer {name!r}: shape {tuple(tensor.shape)} is not [k * {num_blocks} blocks, ...]")
    ratio = tensor.shape[0] // num_blocks
    row = tensor.stride(0) * tensor.element_size()
    if not tensor[0].is_contiguous() or tensor[0].numel() * tensor.element_size() != row:
        raise LayoutError(f"KV cache layer {name!r}: a block is not one contiguous run (stride {tensor.stride()}); "
                          "kvbroker moves a layer's block as one page")
    item_len = row * ratio
    if spec is not None and getattr(spec, "page_size_bytes", item_len) != item_len:
        raise LayoutError(f"KV cache layer {name!r}: {item_len} bytes per block in the tensor, "
                          f"{spec.page_size_bytes} in its spec")
    return tensor.data_ptr(), num_blocks * item_len, item_len


def engine_components(kv_caches: Mapping[str, object], specs: Mapping[str, object], num_blocks: int, refs: RefsFn
                      ) -> list[ComponentSpec]:
    """MAIN_KV (and MINIMAX_INDEX_K where there are index caches), one FLAT buffer per layer in layer
    order, `num_blocks` (vLLM's block count) pages each."""
    by_component: dict[Component, list[tuple[int, str]]] = {}
    for name in kv_caches:
        by_component.setdefault(component_of(specs.get(name)), []).append((layer_id(name), name))
    components = []
    for component in (Component.MAIN_KV, Component.MINIMAX_INDEX_K):
        layers = sorted(by_component.get(component, ()))
        if not layers:
            continue
        if len({lid for lid, _ in layers}) != len(layers):
            raise LayoutError(f"{component.name}: two KV cache layers with one layer id: {[n for _, n in layers]}")
        pages = [_page(name, kv_caches[name], specs.get(name), num_blocks) for _, name in layers]
        memory = refs([a for a, _, _ in pages], [n for _, n, _ in pages], f"{component.name} KV caches")
        buffers = tuple(LayerBuffer(lid, BufferRole.FLAT, ref, length, item)
                        for (lid, _), ref, (_, length, item) in zip(layers, memory, pages))
        components.append(ComponentSpec(component, Layout.FLAT, min(b.num_pages for b in buffers), buffers))
    if not components:
        raise LayoutError("no KV cache layers to register")
    return components


def engine_topology(components: Sequence[ComponentSpec], specs: Mapping[str, Any], *, block_size: int,
                    tp_size: int, tp_rank: int, pp_size: int, pp_rank: int, dp_rank: int) -> Topology:
    layers = [b.layer_id for c in components for b in c.layer_buffers]
    dtypes = {str(spec.dtype) for spec in specs.values() if hasattr(spec, "dtype")}
    main = [spec for spec in specs.values() if component_of(spec) is Component.MAIN_KV]
    dtype = str(main[0].dtype) if main else (dtypes.pop() if len(dtypes) == 1 else "")
    try:
        kv = kv_dtype(dtype)
    except ValueError as exc:
        raise LayoutError(f"KV cache dtype: {exc}") from None
    return Topology(page_size=block_size, start_layer=min(layers), end_layer=max(layers) + 1, kv_dtype=KvDtype(kv),
                    tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, dp_rank=dp_rank)
