"""A small engine over a SharedPool, built with the public client only: shared by the client tests."""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker_client import Component, ComponentSpec, KvDtype, Topology
from kvbroker_client.tensors import SharedPool, flat_component, kv_split_component
from tests.support.pools import Pools


@dataclass
class PoolEngine:
    engine_id: str
    pool: SharedPool
    topology: Topology
    components: list[ComponentSpec]


def pool_engine(pools: Pools, engine_id: str, *, fill: str, seed: int = 0, layers: int = 3,
                sparse_layers: tuple[int, ...] = (1, 2), num_pages: int = 32, kv_item: int = 64,
                index_item: int = 16, page_size: int = 4, **topology) -> PoolEngine:
    """MAIN_KV (K and V per layer) and MINIMAX_INDEX_K on `sparse_layers`, as numpy arrays in one pool."""
    regions = 2 * layers + len(sparse_layers)
    pool = pools.make(regions * (-(-num_pages * kv_item // 4096) * 4096 + 4096) + 4096, fill=fill, seed=seed)
    k = [pool.numpy((num_pages, kv_item)) for _ in range(layers)]
    v = [pool.numpy((num_pages, kv_item)) for _ in range(layers)]
    index = [pool.numpy((num_pages, index_item)) for _ in sparse_layers]
    components = [kv_split_component(k, v, segments=pool)]
    if sparse_layers:
        components.append(flat_component(index, layer_ids=sparse_layers, segments=pool,
                                         component=Component.MINIMAX_INDEX_K))
    fields = dict(page_size=page_size, start_layer=0, end_layer=layers, kv_dtype=KvDtype.BFLOAT16)
    fields.update(topology)
    return PoolEngine(engine_id, pool, Topology(**fields), components)
