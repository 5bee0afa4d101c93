"""`kvbroker demo`: a real prefill → decode transfer through two brokers, verified to the byte.

Plays both inference servers: one shared-memory pool per side holding a MiniMax-M3-shaped engine
(MAIN_KV as K and V per layer on every layer, MINIMAX_INDEX_K on the sparse layers), registers
each with its own broker process, grants a fragmented page list on the decode side, transfers it
from the prefill side, then checks every destination page and every canary byte around them.
The shape helpers here are shared with the benchmarks and the integration tests.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import grpc
import numpy as np

from kvbroker.launch import start_broker
from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb

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


@dataclass(frozen=True)
class BufferPlacement:
    component: int  # pb.Component value
    layer_id: int
    role: int  # pb.BufferRole value
    offset: int
    item_len: int


def place_buffers(shape: ModelShape, components=("MAIN_KV", "MINIMAX_INDEX_K"),
                  main_layout: str = "KV_SPLIT") -> list[BufferPlacement]:
    """Lay out every layer buffer back to back in one pool, in registration order."""
    placements, offset = [], 0
    if "MAIN_KV" in components:
        roles = [pb.BUFFER_ROLE_K, pb.BUFFER_ROLE_V] if main_layout == "KV_SPLIT" else [pb.BUFFER_ROLE_FLAT]
        item = shape.kv_item_len if main_layout == "KV_SPLIT" else 2 * shape.kv_item_len
        for layer in range(shape.layers):
            for role in roles:
                placements.append(BufferPlacement(pb.COMPONENT_MAIN_KV, layer, role, offset, item))
                offset += shape.num_pages * item
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
               pb.COMPONENT_MINIMAX_INDEX_K: pb.LAYOUT_FLAT}
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


def fill_random(array: np.ndarray, rng: np.random.Generator) -> None:
    words = array[: array.size // 8 * 8].view(np.uint64)
    words[:] = rng.integers(0, 2**64, size=words.size, dtype=np.uint64)
    array[words.size * 8:] = rng.integers(0, 256, size=array.size - words.size * 8, dtype=np.uint8)


async def run(preset: str, backend: str, seed: int, as_json: bool) -> int:
    shape = PRESETS[preset]
    rng = np.random.default_rng(seed)
    placements = place_buffers(shape)
    size = pool_size(shape, placements)
    prefill = decode = None
    with SharedSegment.create(size, "kvb-prefill") as src_seg, SharedSegment.create(size, "kvb-decode") as dst_seg:
        try:
            prefill, decode = await asyncio.gather(
                start_broker("prefill", "--backend", backend, "--log-level", "WARNING"),
                start_broker("decode", "--backend", backend, "--log-level", "WARNING"),
            )
            fill_random(src_seg.array, rng)
            dst_seg.array[:] = CANARY
            before = dst_seg.array.copy()
            src_ids = fragmented_pages(rng, shape.num_pages, shape.request_pages)
            dst_ids = fragmented_pages(rng, shape.num_pages, shape.request_pages)
            async with grpc.aio.insecure_channel(prefill.listen) as p_chan, \
                    grpc.aio.insecure_channel(decode.listen) as d_chan:
                p_stub, d_stub = bpb_grpc.BrokerServiceStub(p_chan), bpb_grpc.BrokerServiceStub(d_chan)
                await p_stub.RegisterEngine(register_request("prefill-0/tp0", shape, src_seg, placements), timeout=30)
                await d_stub.RegisterEngine(register_request("decode-0/tp0", shape, dst_seg, placements), timeout=30)
                components = [pb.COMPONENT_MAIN_KV, pb.COMPONENT_MINIMAX_INDEX_K]
                await d_stub.ExpectTransfer(bpb.ExpectTransferRequest(
                    request_id="demo-1", engine_id="decode-0/tp0", components=components,
                    dst_page_ids=dst_ids.tolist(), expiry_ms=60_000), timeout=10)
                watch = d_stub.WatchTransfer(bpb.WatchTransferRequest(engine_id="decode-0/tp0",
                                                                      request_id="demo-1"), timeout=120)
                started = time.perf_counter()
                reply = await p_stub.Transfer(bpb.TransferRequest(
                    request_id="demo-1", engine_id="prefill-0/tp0", peer_address=decode.peer_listen,
                    remote_engine_id="decode-0/tp0", components=components, src_page_ids=src_ids.tolist()),
                    timeout=120)
                elapsed = time.perf_counter() - started
                states = [pb.TransferState.Name(update.status.state) async for update in watch]
            expected = expected_destination(src_seg.array, before, shape, placements, set(components),
                                            src_ids, dst_ids)
            mismatched = int(np.count_nonzero(dst_seg.array != expected))
        finally:
            for broker in (prefill, decode):
                if broker is not None:
                    await broker.stop()
    status = reply.status
    figures = {
        "preset": shape.name, "backend": backend,
        "layers": {"dense": shape.dense_layers, "sparse": shape.sparse_layers}, "page_size": shape.page_size,
        "components": ["MAIN_KV (KV_SPLIT)", "MINIMAX_INDEX_K (FLAT)"],
        "pages": status.pages, "runs": status.runs, "layer_buffers": len(placements),
        "descriptors": status.runs * len(placements), "bytes": status.bytes,
        "seconds": round(elapsed, 6), "gb_per_s": round(status.bytes / elapsed / 1e9, 3),
        "broker_duration_us": status.duration_us, "receiver_states": states,
        "mismatched_bytes": mismatched, "verified": mismatched == 0,
    }
    if as_json:
        print(json.dumps(figures))
    else:
        print(f"kvbroker demo ({shape.name}, {backend}): {shape.dense_layers} dense + {shape.sparse_layers} sparse "
              f"layers, page_size {shape.page_size}, MAIN_KV + MINIMAX_INDEX_K")
        print(f"  moved     {status.pages} pages in {status.runs} runs x {len(placements)} layer buffers "
              f"= {figures['descriptors']} descriptors")
        print(f"  bytes     {status.bytes:,} in {elapsed * 1e3:.2f} ms  ({figures['gb_per_s']} GB/s, "
              f"client-observed Transfer)")
        print(f"  receiver  {' -> '.join(states)}")
        print(f"  verified  {'every destination page and canary matches' if mismatched == 0 else 'MISMATCH'}"
              f" ({mismatched} bytes differ)")
    return 0 if mismatched == 0 and states[-1:] == ["TRANSFER_STATE_SUCCEEDED"] else 1
