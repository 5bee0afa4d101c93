"""`kvbroker demo`: a real prefill → decode transfer through two brokers, verified to the byte.

Plays both inference servers of SGLang 0.5.23's MiniMax-M3 PD flow, each through kvbroker's
client (BrokerClient) to its own broker process, over its own shared-memory pool: MAIN_KV (K and
V of the sparse layers), MINIMAX_INDEX_K (the sparse layers' K-only index) and MINIMAX_DENSE_KV
(the dense layers' K and V). Decode, with a cached prefix, grants a fragmented page list per
component and offers it to the prefill broker; prefill sends the main KV in chunks (chunked
prefill), the last chunk with the index-K suffix after decode's prefix, the dense KV of every page
and the aux bytes (first token, metadata). Decode then checks every destination page, every canary
byte around them and the aux bytes it received with SUCCEEDED.
Its shapes and pool helpers are tooling/src/kvbroker_tools/shapes.py, shared with the bench and the tests.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from kvbroker_client import BrokerClient, Component
from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools.launch import start_broker, stop_all
from kvbroker_tools.shapes import (
    CANARY,
    PRESETS,
    expected_destination,
    fill_random,
    fragmented_pages,
    place_buffers,
    pool_size,
    register_request,
)

COMPONENTS = ("MAIN_KV", "MINIMAX_INDEX_K", "MINIMAX_DENSE_KV")
CHUNKS = 4  # parts of the main KV
PREFIX_PAGES = 2  # pages decode holds already: the index K moves only the suffix after them
AUX_BYTES = 2048


async def run(preset: str, backend: str, seed: int, as_json: bool) -> int:
    shape = PRESETS[preset]
    rng = np.random.default_rng(seed)
    placements = place_buffers(shape, COMPONENTS)
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
            aux = rng.integers(0, 256, AUX_BYTES, dtype=np.uint8).tobytes()
            run_ = await _request(prefill, decode, shape, placements, src_seg, dst_seg, src_ids, dst_ids, aux)
            expected = before
            for kind, src, dst in ((pb.COMPONENT_MAIN_KV, src_ids, dst_ids),
                                   (pb.COMPONENT_MINIMAX_INDEX_K, src_ids[PREFIX_PAGES:], dst_ids[PREFIX_PAGES:]),
                                   (pb.COMPONENT_MINIMAX_DENSE_KV, src_ids, dst_ids)):
                expected = expected_destination(src_seg.array, expected, shape, placements, {kind}, src, dst)
            mismatched = int(np.count_nonzero(dst_seg.array != expected))
        finally:
            await stop_all((prefill, decode))
    status, states, elapsed = run_["status"], run_["states"], run_["seconds"]
    aux_ok = status.aux == aux
    figures = {
        "preset": shape.name, "backend": backend, "flow": "offered (decode-initiated), chunked",
        "layers": {"dense": shape.dense_layers, "sparse": shape.sparse_layers}, "page_size": shape.page_size,
        "components": ["MAIN_KV (KV_SPLIT, sparse layers)", "MINIMAX_INDEX_K (FLAT)",
                       "MINIMAX_DENSE_KV (KV_SPLIT, dense layers)"],
        "parts": status.parts, "pages": status.pages, "layer_buffers": len(placements), "bytes": status.bytes,
        "seconds": round(elapsed, 6), "gb_per_s": round(status.bytes / elapsed / 1e9, 3),
        "receiver_states": states, "aux_bytes": len(status.aux), "aux_verified": aux_ok,
        "mismatched_bytes": mismatched, "verified": mismatched == 0 and aux_ok,
    }
    if as_json:
        print(json.dumps(figures))
    else:
        print(f"kvbroker demo ({shape.name}, {backend}): {shape.dense_layers} dense + {shape.sparse_layers} sparse "
              f"layers, page_size {shape.page_size}, MAIN_KV + MINIMAX_INDEX_K + MINIMAX_DENSE_KV")
        print(f"  flow      decode offered its grant; prefill sent {status.parts} parts (main KV in {CHUNKS} chunks, "
              f"index-K suffix after {PREFIX_PAGES} cached pages and dense KV with the last)")
        print(f"  moved     {status.pages} pages over {len(placements)} layer buffers, {status.bytes:,} bytes in "
              f"{elapsed * 1e3:.2f} ms ({figures['gb_per_s']} GB/s, first part to last)")
        print(f"  receiver  {' -> '.join(states)}")
        print(f"  aux       {len(status.aux):,} bytes with SUCCEEDED, {'equal' if aux_ok else 'DIFFERENT'}")
        print(f"  verified  {'every destination page and canary matches' if mismatched == 0 else 'MISMATCH'}"
              f" ({mismatched} bytes differ)")
    return 0 if figures["verified"] and states[-1:] == ["SUCCEEDED"] else 1


async def _request(prefill, decode, shape, placements, src_seg, dst_seg, src_ids, dst_ids, aux) -> dict:
    """Both servers' calls, through their clients: register, grant and offer, parts, watch."""
    async with await BrokerClient.connect(prefill.listen) as p_client, \
            await BrokerClient.connect(decode.listen) as d_client:
        for client, engine, seg in ((p_client, "prefill-0/tp0", src_seg), (d_client, "decode-0/tp0", dst_seg)):
            request = register_request(engine, shape, seg, placements)
            await client.register_engine(engine, request.topology, list(request.components), timeout=30)
        grant = {Component.MAIN_KV: dst_ids, Component.MINIMAX_INDEX_K: dst_ids[PREFIX_PAGES:],
                 Component.MINIMAX_DENSE_KV: dst_ids}
        await d_client.expect_transfer("decode-0/tp0", "demo-1", grant, sender_address=prefill.peer_listen,
                                       sender_engine_id="prefill-0/tp0", expiry_s=120)
        states: list[str] = []

        async def watch():
            async for update in d_client.watch("decode-0/tp0", "demo-1", timeout=120):
                if not states or states[-1] != update.state.name or update.parts:
                    states.append(update.state.name + (f"({update.parts})" if update.parts and not
                                                       update.state.terminal else ""))
                last = update
            return last

        watching = asyncio.create_task(watch())
        bounds = np.linspace(0, len(src_ids), CHUNKS + 1).astype(int)
        started = time.perf_counter()
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            pages = {Component.MAIN_KV: src_ids[start:end]}
            last = i == CHUNKS - 1
            if last:
                pages |= {Component.MINIMAX_INDEX_K: src_ids[PREFIX_PAGES:], Component.MINIMAX_DENSE_KV: src_ids}
            await p_client.transfer_part("prefill-0/tp0", "demo-1", pages, dst_offsets={Component.MAIN_KV: start},
                                         last=last, aux=aux if last else b"", timeout=120)
        elapsed = time.perf_counter() - started
        status = await asyncio.wait_for(watching, 120)
    return {"status": status, "states": states, "seconds": elapsed}
