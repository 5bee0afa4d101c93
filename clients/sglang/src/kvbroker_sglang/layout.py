"""SGLang's KVArgs as kvbroker components: which buffer is which layer, role and page size.

KVArgs lists buffers by position only. Their layers come from, in this order:
    kv_args.kv_layer_ids            when SGLang filled it (hybrid pools: one id per entry)
    kv_args.kvbroker_pool           recorded from the pool by the plugin's hook on setup_state_kv_args
    the pool's [start, end) layers  plain MHA (K of every layer, then V) or MLA (one per layer)

For SGLang 0.5.23's MiniMaxSparseKVPool (`get_kv_transfer_buf_infos`, `setup_state_kv_args`):
    MAIN_KV           the sparse layers' K, then their V          KV_SPLIT
    MINIMAX_INDEX_K   one K-only index buffer per K-only layer    FLAT
    MINIMAX_DENSE_KV  the dense layers' K, then their V           KV_SPLIT
Item lens are bytes per page, so SGLang's page indices are kvbroker page ids as they are.

    PoolLayers.of(pool)                            what the hook records
    engine_components(kv_args, refs, is_mla=...)   ComponentSpecs; `refs` exports each pointer
    engine_topology(kv_args, parallel)             Topology
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbroker_client import BufferRole, Component, ComponentSpec, KvDtype, LayerBuffer, Layout, MemoryRef, Topology
from kvbroker_client.tensors import kv_dtype

# SGLang StateType values and the component each becomes; others have no kvbroker component yet.
STATE_COMPONENTS = {
    "minimax_index_k": Component.MINIMAX_INDEX_K,
    "minimax_dense_kv": Component.MINIMAX_DENSE_KV,
}

RefsFn = Callable[[Sequence[int], Sequence[int], str], list[MemoryRef]]


class LayoutError(ValueError):
    """KVArgs that kvbroker cannot describe as components; the message names the list and the count."""


@dataclass(frozen=True)
class PoolLayers:
    """The global layer ids behind a pool's transfer buffers, read from the pool object itself."""

    start_layer: int
    end_layer: int
    main_layers: tuple[int, ...]  # layers of kv_data_ptrs (each K then V for MHA)
    index_k_layers: tuple[int, ...] = ()
    dense_layers: tuple[int, ...] = ()
    dtype: str = ""  # the pool's store dtype, e.g. "bfloat16"

    @classmethod
    def of(cls, pool) -> PoolLayers | None:
        start = getattr(pool, "start_layer", None)
        end = getattr(pool, "end_layer", None)
        dtype = str(getattr(pool, "store_dtype", getattr(pool, "dtype", ""))).removeprefix("torch.")
        if start is None or end is None:
            return None
        if hasattr(pool, "sparse_layer_id_mapping") and hasattr(pool, "index_k_layer_id_mapping"):
            index_k = sorted(pool.index_k_layer_id_mapping, key=pool.index_k_layer_id_mapping.get)
            return cls(start, end, tuple(sorted(pool.sparse_layer_id_mapping)), tuple(index_k),
                       tuple(sorted(getattr(pool, "_dense_layer_ids", ()))), dtype)
        return cls(start, end, tuple(range(start, end)), dtype=dtype)


def _state_name(state_type) -> str:
    return str(getattr(state_type, "value", state_type)).lower()


def _component(component: Component, layout: Layout, keys: Sequence[tuple[int, BufferRole]], ptrs, lens, item_lens,
               refs: RefsFn, what: str) -> ComponentSpec:
    if not len(ptrs) == len(lens) == len(item_lens) == len(keys):
        raise LayoutError(f"{what}: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} item lengths for "
                          f"{len(keys)} layer buffers ({', '.join(f'{layer}{role.name}' for layer, role in keys)})")
    memory = refs(ptrs, lens, what)
    buffers = tuple(LayerBuffer(layer, role, ref, int(n), int(item))
                    for (layer, role), ref, n, item in zip(keys, memory, lens, item_lens))
    return ComponentSpec(component, layout, min(b.length // b.item_len for b in buffers), buffers)


def _split(layers: Sequence[int]) -> list[tuple[int, BufferRole]]:
    return [(layer, BufferRole.K) for layer in layers] + [(layer, BufferRole.V) for layer in layers]


def main_kv_keys(kv_args, pool: PoolLayers | None, *, is_mla: bool) -> tuple[Layout, list[tuple[int, BufferRole]]]:
    count = len(kv_args.kv_data_ptrs)
    ids = list(getattr(kv_args, "kv_layer_ids", None) or ())
    if is_mla:
        layers = ids or list(pool.main_layers if pool else ())
        if len(layers) != count:
            raise LayoutError(f"kv_data_ptrs: {count} MLA buffers but {len(layers)} layer ids {layers}")
        return Layout.FLAT, [(layer, BufferRole.FLAT) for layer in layers]
    if ids:
        if len(ids) != count or count % 2 or ids[: count // 2] != ids[count // 2:]:
            raise LayoutError(f"kv_data_ptrs: kv_layer_ids {ids} do not read as K of each layer then V")
        return Layout.KV_SPLIT, _split(ids[: count // 2])
    layers = list(pool.main_layers) if pool else []
    if 2 * len(layers) != count:
        raise LayoutError(f"kv_data_ptrs: {count} buffers, but the pool's main layers {layers} need "
                          f"{2 * len(layers)} (K then V each); kv_layer_ids is empty and the pool was not recorded "
                          "(is the kvbroker plugin loaded?)")
    return Layout.KV_SPLIT, _split(layers)


def state_component(kv_args, i: int, pool: PoolLayers | None, refs: RefsFn) -> ComponentSpec:
    name = _state_name(kv_args.state_types[i])
    if name not in STATE_COMPONENTS:
        raise LayoutError(f"state_types[{i}]: SGLang state {name!r} has no kvbroker component "
                          f"(kvbroker moves {', '.join(STATE_COMPONENTS)})")
    component = STATE_COMPONENTS[name]
    ptrs, lens, items = kv_args.state_data_ptrs[i], kv_args.state_data_lens[i], kv_args.state_item_lens[i]
    given = list((getattr(kv_args, "state_layer_ids", None) or [[]] * (i + 1))[i] or ())
    what = f"state_data_ptrs[{i}] ({name})"
    if component is Component.MINIMAX_INDEX_K:
        layers = given or list(pool.index_k_layers if pool else ())
        if len(layers) != len(ptrs):
            raise LayoutError(f"{what}: {len(ptrs)} index buffers but layer ids {layers} (record the pool: is the "
                              "kvbroker plugin loaded?)")
        return _component(component, Layout.FLAT, [(x, BufferRole.FLAT) for x in layers], ptrs, lens, items, refs,
                          what)
    layers = (given[: len(given) // 2] if given else list(pool.dense_layers if pool else ()))
    if 2 * len(layers) != len(ptrs):
        raise LayoutError(f"{what}: {len(ptrs)} dense buffers but dense layers {layers} need {2 * len(layers)}")
    return _component(component, Layout.KV_SPLIT, _split(layers), ptrs, lens, items, refs, what)


def engine_components(kv_args, refs: RefsFn, *, is_mla: bool = False) -> list[ComponentSpec]:
    """Every component of a KVArgs: MAIN_KV, then one per state type, in KVArgs's order."""
    pool: PoolLayers | None = getattr(kv_args, "kvbroker_pool", None)
    layout, keys = main_kv_keys(kv_args, pool, is_mla=is_mla)
    main = _component(Component.MAIN_KV, layout, keys, kv_args.kv_data_ptrs, kv_args.kv_data_lens,
                      kv_args.kv_item_lens, refs, "kv_data_ptrs")
    states = [state_component(kv_args, i, pool, refs) for i in range(len(getattr(kv_args, "state_types", ()) or ()))]
    return [main, *states]


def state_component_of(kv_args, i: int) -> Component:
    return STATE_COMPONENTS[_state_name(kv_args.state_types[i])]


_DTYPE_STRINGS = {"auto": None, "bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn",
                  "fp8_e5m2": "float8_e5m2"}


def engine_topology(kv_args, components: Sequence[ComponentSpec], *, tp_size: int, tp_rank: int, attn_tp_size: int,
                    attn_tp_rank: int, pp_size: int, pp_rank: int, dp_rank: int) -> Topology:
    pool: PoolLayers | None = getattr(kv_args, "kvbroker_pool", None)
    layers = [b.layer_id for c in components for b in c.layer_buffers]
    start = pool.start_layer if pool else int(getattr(kv_args, "prefill_start_layer", min(layers)))
    end = pool.end_layer if pool and pool.end_layer is not None else max(layers) + 1
    dtype_name = pool.dtype if pool and pool.dtype else None
    if dtype_name is None:
        given = str(getattr(kv_args, "kv_cache_dtype_str", "") or "")
        dtype_name = _DTYPE_STRINGS.get(given, given)
        if not dtype_name:
            raise LayoutError(f"kv_cache_dtype_str {given!r} names no dtype and the pool was not recorded")
    try:
        dtype = kv_dtype(dtype_name)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    return Topology(page_size=int(kv_args.page_size), start_layer=start, end_layer=end, kv_dtype=KvDtype(dtype),
                    tp_size=tp_size, tp_rank=tp_rank, attn_tp_size=attn_tp_size, attn_tp_rank=attn_tp_rank,
                    pp_size=pp_size, pp_rank=pp_rank, dp_rank=dp_rank)
