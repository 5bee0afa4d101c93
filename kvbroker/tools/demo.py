"""`kvbroker demo`: a real prefill → decode transfer through two brokers, verified to the byte.

Plays both inference servers: one shared-memory pool per side holding a MiniMax-M3-shaped engine
(MAIN_KV as K and V per layer on every layer, MINIMAX_INDEX_K on the sparse layers), registers
each with its own broker process, grants a fragmented page list on the decode side, transfers it
from the prefill side, then checks every destination page and every canary byte around them.
Its shapes and pool helpers are kvbroker/tools/shapes.py, shared with the bench and the tests.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import numpy as np

from kvbroker.tools.launch import start_broker, stop_all
from kvbroker.tools.shapes import (
    CANARY,
    PRESETS,
    expected_destination,
    fill_random,
    fragmented_pages,
    place_buffers,
    pool_size,
    register_request,
)
from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb


async def run(preset: str, backend: str, seed: int, as_json: bool) -> int:
    shape = PRESETS[preset]
    rng = np.random.default_rng(seed)
    placements = place_buffers(shape)
    size = pool_size(shape, placements)
    prefill = decode = None
    with SharedSegment.create(size, "kvb-prefill") as src_seg, SharedSegment.create(size, "kvb-decode") as dst_seg:
        try:
            started = await asyncio.gather(
                start_broker("prefill", "--backend", backend, "--log-level", "WARNING"),
                start_broker("decode", "--backend", backend, "--log-level", "WARNING"),
                return_exceptions=True)
            prefill, decode = (None if isinstance(b, BaseException) else b for b in started)
            for failure in (b for b in started if isinstance(b, BaseException)):
                raise failure
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
            await stop_all((prefill, decode))  # a broker that died says how, with its stderr tail
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
