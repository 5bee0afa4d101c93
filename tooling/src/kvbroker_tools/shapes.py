"""Model shapes and pools for the tooling and the tests: one place for the demo's, the bench's and
the suite's MiniMax-M3-like engines, and for laying them out in shared memory.

- `ModelShape` and its presets: `PRESETS` (the demo's toy and large), `SMALL` (the tests'),
  `BENCH_ENGINE` and `BENCH_CONTROL` (the bench's data-plane and control-plane engines);
- a pool: `place_buffers` (every layer buffer back to back), `pool_size`, `fill_random`, `CANARY`;
- registration: `topology`, `register_request` (a RegisterEngineRequest over a shared segment);
- page lists: `fragmented_pages` (demo, tests), `page_lists` and `sized` (bench);
- checks: `expected_destination` (the destination pool after a transfer), `moved_pages_match`;
- `engine_buffers`: a pool's layer buffers as the broker orders them, for driving a Backend directly.

Callers: tooling/src/kvbroker_tools (demo, bench), tests/, benchmarks/gpu_check.py. The daemon never imports it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb

MiB = 1 << 20
ALL = (1, 2)  # pb.COMPONENT_MAIN_KV, pb.COMPONENT_MINIMAX_INDEX_K: one page list carries both

CANARY = 0xA5


@dataclass(frozen=True)
class ModelShape:
    """A MiniMax-M3-like cache: dense layers, then sparse layers that also carry the K-only index."""

    name: str
    dense_layers: int
    sparse_layers: int
    page_size: int  # tokens per page
    kv_heads: int  # per attention-TP rank
    head_dim: int
    kv_bytes: int  # bytes per element of MAIN_KV (bf16: 2)
    index_head_dim: int
    index_bytes: int  # bytes per element of the index (fp8: 1)
    num_pages: int
    request_pages: int

    @property
    def layers(self) -> int:
        return self.dense_layers + self.sparse_layers

    @property
    def sparse_layer_ids(self) -> range:
        return range(self.dense_layers, self.layers)

    @property
    def kv_item_len(self) -> int:
        return self.page_size * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def index_item_len(self) -> int:
        return self.page_size * self.index_head_dim * self.index_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * (2 * self.layers * self.kv_item_len + self.sparse_layers * self.index_item_len)

    def request_bytes(self, pages: int | None = None) -> int:
        pages = self.request_pages if pages is None else pages
        return pages * (2 * self.layers * self.kv_item_len + self.sparse_layers * self.index_item_len)


PRESETS = {
    "toy": ModelShape("toy", 3, 4, page_size=16, kv_heads=2, head_dim=64, kv_bytes=2, index_head_dim=64,
                      index_bytes=1, num_pages=256, request_pages=96),
    "large": ModelShape("large", 3, 4, page_size=64, kv_heads=8, head_dim=128, kv_bytes=2, index_head_dim=128,
                        index_bytes=1, num_pages=1024, request_pages=768),
}


# The tests' small MiniMax-M3-like shape: 3 dense + 4 sparse layers, 64 pages per buffer.
SMALL = ModelShape("small", 3, 4, page_size=4, kv_heads=1, head_dim=32, kv_bytes=2, index_head_dim=16,
                   index_bytes=1, num_pages=64, request_pages=24)
# The bench's MiniMax-M3-like engine, per attention-TP rank: 64 layers, each with MAIN_KV as K and V
# (bf16, one KV head of 128) and the K-only index MINIMAX_INDEX_K (fp8, 128 wide); 16-token pages.
# 192 layer buffers, 4 KiB (K, V) and 2 KiB (index) per page and buffer, 640 KiB per page over the model.
BENCH_ENGINE = ModelShape("m3-bench", dense_layers=0, sparse_layers=64, page_size=16, kv_heads=1, head_dim=128,
                          kv_bytes=2, index_head_dim=128, index_bytes=1, num_pages=1024, request_pages=1)
# The bench's control plane moves one page of a one-layer engine (3 layer buffers, 10 KiB): latency, not bytes.
BENCH_CONTROL = dataclasses.replace(BENCH_ENGINE, name="control", sparse_layers=1, num_pages=256)


@dataclass(frozen=True)
class BufferPlacement:
    component: int  # pb.Component value
    layer_id: int
    role: int  # pb.BufferRole value
    offset: int
    item_len: int


def place_buffers(shape: ModelShape, components=("MAIN_KV", "MINIMAX_INDEX_K"),
                  main_layout: str = "KV_SPLIT") -> list[BufferPlacement]:
    """Lay out every layer buffer back to back in one pool, in registration order. With
    MINIMAX_DENSE_KV, as SGLang 0.5.23 registers MiniMax-M3: MAIN_KV holds the sparse layers and
    MINIMAX_DENSE_KV the dense layers' K and V; without it, MAIN_KV holds every layer."""
    placements, offset = [], 0
    dense_state = "MINIMAX_DENSE_KV" in components
    if "MAIN_KV" in components:
        roles = [pb.BUFFER_ROLE_K, pb.BUFFER_ROLE_V] if main_layout == "KV_SPLIT" else [pb.BUFFER_ROLE_FLAT]
        item = shape.kv_item_len if main_layout == "KV_SPLIT" else 2 * shape.kv_item_len
        for layer in (shape.sparse_layer_ids if dense_state else range(shape.layers)):
            for role in roles:
                placements.append(BufferPlacement(pb.COMPONENT_MAIN_KV, layer, role, offset, item))
                offset += shape.num_pages * item
    if dense_state:
        for layer in range(shape.dense_layers):
            for role in (pb.BUFFER_ROLE_K, pb.BUFFER_ROLE_V):
                placements.append(BufferPlacement(pb.COMPONENT_MINIMAX_DENSE_KV, layer, role, offset,
                                                  shape.kv_item_len))
                offset += shape.num_pages * shape.kv_item_len
    if "MINIMAX_INDEX_K" in components:
        for layer in shape.sparse_layer_ids:
            placements.append(BufferPlacement(pb.COMPONENT_MINIMAX_INDEX_K, layer, pb.BUFFER_ROLE_FLAT, offset,
                                              shape.index_item_len))
            offset += shape.num_pages * shape.index_item_len
    return placements


def pool_size(shape: ModelShape, placements: list[BufferPlacement]) -> int:
    return max(p.offset + shape.num_pages * p.item_len for p in placements) + 4096  # a canary tail


def topology(shape: ModelShape, **overrides) -> pb.Topology:
    fields = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0, dp_rank=0,
                  page_size=shape.page_size, start_layer=0, end_layer=shape.layers,
                  kv_dtype=pb.KV_DTYPE_BFLOAT16)
    fields.update(overrides)
    return pb.Topology(**fields)


def register_request(engine_id: str, shape: ModelShape, segment: SharedSegment,
                     placements: list[BufferPlacement], main_layout: str = "KV_SPLIT",
                     topo: pb.Topology | None = None) -> bpb.RegisterEngineRequest:
    layouts = {pb.COMPONENT_MAIN_KV: pb.LAYOUT_KV_SPLIT if main_layout == "KV_SPLIT" else pb.LAYOUT_FLAT,
               pb.COMPONENT_MINIMAX_INDEX_K: pb.LAYOUT_FLAT, pb.COMPONENT_MINIMAX_DENSE_KV: pb.LAYOUT_KV_SPLIT}
    components = []
    for kind in dict.fromkeys(p.component for p in placements):
        components.append(pb.ComponentSpec(
            component=kind, layout=layouts[kind], num_pages=shape.num_pages,
            layer_buffers=[pb.LayerBuffer(
                layer_id=p.layer_id, role=p.role,
                memory=pb.MemoryRef(shared_memory=pb.SharedMemoryRef(name=segment.name, offset=p.offset)),
                length=shape.num_pages * p.item_len, item_len=p.item_len,
            ) for p in placements if p.component == kind],
        ))
    return bpb.RegisterEngineRequest(engine_id=engine_id, topology=topo or topology(shape), components=components)


def fragmented_pages(rng: np.random.Generator, num_pages: int, count: int, max_run: int = 16) -> np.ndarray:
    """`count` distinct page ids made of runs of 1..max_run consecutive pages, in shuffled order."""
    blocks = rng.permutation(num_pages // max_run)
    if count > blocks.size * max_run:
        raise ValueError(f"cannot place {count} fragmented pages in a pool of {num_pages}")
    lengths = rng.integers(1, max_run + 1, size=blocks.size)
    while lengths.sum() < count:  # lengthen runs until the blocks hold the request
        lengths = np.minimum(max_run, lengths + 1)
    out, taken = [], 0
    for block, n in zip(blocks.tolist(), lengths.tolist()):
        n = min(n, count - taken)
        out.append(np.arange(block * max_run, block * max_run + n))
        taken += n
        if taken == count:
            break
    return np.concatenate(out).astype(np.int64)


def expected_destination(src: np.ndarray, dst_before: np.ndarray, shape: ModelShape,
                         placements: list[BufferPlacement], components: set[int],
                         src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray:
    """The destination pool as it must look after the transfer: canaries everywhere but the moved pages."""
    expected = dst_before.copy()
    for p in placements:
        if p.component not in components:
            continue
        span = shape.num_pages * p.item_len
        s = src[p.offset:p.offset + span].reshape(shape.num_pages, p.item_len)
        d = expected[p.offset:p.offset + span].reshape(shape.num_pages, p.item_len)
        d[dst_ids] = s[src_ids]
    return expected


def fill_random(array: np.ndarray, rng: np.random.Generator, chunk: int = 64 * MiB) -> None:
    """Random bytes in `array`, in chunks: no temporary as large as the pool."""
    for start in range(0, array.size, chunk):
        _fill_chunk(array[start:start + chunk], rng)


def _fill_chunk(array: np.ndarray, rng: np.random.Generator) -> None:
    words = array[: array.size // 8 * 8].view(np.uint64)
    words[:] = rng.integers(0, 2**64, size=words.size, dtype=np.uint64)
    array[words.size * 8:] = rng.integers(0, 256, size=array.size - words.size * 8, dtype=np.uint8)


def sized(nbytes: int) -> tuple[ModelShape, int]:
    """The bench engine with a pool just large enough for a request of at least `nbytes`; and its page count."""
    pages = max(1, math.ceil(nbytes / BENCH_ENGINE.request_bytes(1)))
    return dataclasses.replace(BENCH_ENGINE, num_pages=math.ceil(pages / 16) * 16, request_pages=pages), pages


PATTERNS = ("contiguous", "runs16", "scattered")  # what page_lists makes


def page_lists(pattern: str, pages: int, pool: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination page ids: one run, runs of 16 in shuffled order, or every page on its own."""
    if pattern == "contiguous":
        ids = np.arange(pages, dtype=np.int64)
        return ids, ids.copy()
    if pattern == "runs16":
        def one() -> np.ndarray:
            blocks = rng.permutation(pool // 16).astype(np.int64)
            return (blocks[:, None] * 16 + np.arange(16)).ravel()[:pages]
        return one(), one()
    if pattern == "scattered":
        return tuple(rng.permutation(pool)[:pages].astype(np.int64) for _ in range(2))
    raise ValueError(f"unknown pattern {pattern!r}")


def engine_buffers(shape: ModelShape, placements, base: int, components=ALL):
    """Layer buffers as the broker orders them for a transfer: by component, then (layer, role)."""
    from kvbroker.core.model import BufferLayout, BufferRole

    out = []
    for kind in components:
        mine = sorted((p for p in placements if p.component == kind), key=lambda p: (p.layer_id, p.role))
        out += [BufferLayout(p.layer_id, BufferRole(p.role), base + p.offset, shape.num_pages * p.item_len,
                             p.item_len) for p in mine]
    return out


def moved_pages_match(shape: ModelShape, placements, src: np.ndarray, dst: np.ndarray,
                      src_ids: np.ndarray, dst_ids: np.ndarray) -> bool:
    for p in placements:
        span = shape.num_pages * p.item_len
        s = src[p.offset:p.offset + span].reshape(shape.num_pages, p.item_len)
        d = dst[p.offset:p.offset + span].reshape(shape.num_pages, p.item_len)
        if not np.array_equal(d[dst_ids], s[src_ids]):
            return False
    return True
