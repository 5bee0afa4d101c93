"""A prefill server and a decode server moving one request's KV cache through two kvbroker sidecars.

Uses only the public client (`kvbroker_client`): each "server" holds a MiniMax-M3-shaped cache in a
SharedPool (MAIN_KV as K and V per layer, MINIMAX_INDEX_K on the sparse layers), registers it with
its own broker, and the two talk the way a PD router makes them talk: decode allocates pages and
grants them, prefill computes its pages and transfers them, decode waits and checks every byte.

    python clients/examples/prefill_decode.py --prefill 127.0.0.1:50051 --decode 127.0.0.1:50061
    python clients/examples/prefill_decode.py --spawn      # starts two local brokers (needs kvbroker)

Brokers and the example must share /dev/shm (same host, or same pod).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

import numpy as np

from kvbroker_client import BrokerClient, Component, ComponentSpec, KvDtype, Topology
from kvbroker_client.tensors import SharedPool, flat_component, kv_split_component

DENSE_LAYERS, SPARSE_LAYERS = 2, 2
NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, INDEX_DIM = 64, 16, 2, 64, 64
REQUEST_PAGES = 24
COMPONENTS = (Component.MAIN_KV, Component.MINIMAX_INDEX_K)
CANARY = 0xA5


@dataclass(frozen=True)
class Handoff:
    """What the decode server tells the prefill server through the router."""

    request_id: str
    engine_id: str
    peer_address: str  # the decode broker's peer address
    page_ids: np.ndarray  # the decode side's pages, for the record


class Cache:
    """One server's KV cache in shared memory: bf16 K/V per layer, an fp8 K-only index per sparse layer."""

    def __init__(self, engine_id: str) -> None:
        layers = DENSE_LAYERS + SPARSE_LAYERS
        kv_bytes = NUM_PAGES * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
        index_bytes = NUM_PAGES * PAGE_SIZE * INDEX_DIM
        self.engine_id = engine_id
        self.pool = SharedPool(2 * layers * kv_bytes + SPARSE_LAYERS * index_bytes + 64 * 4096, prefix="kvb-example")
        page = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.k = [self.pool.numpy(page, np.uint16) for _ in range(layers)]  # bf16 bits; numpy has no bfloat16
        self.v = [self.pool.numpy(page, np.uint16) for _ in range(layers)]
        self.sparse_layers = list(range(DENSE_LAYERS, layers))
        self.index = [self.pool.numpy((NUM_PAGES, PAGE_SIZE, INDEX_DIM), np.uint8) for _ in self.sparse_layers]
        self.topology = Topology(page_size=PAGE_SIZE, start_layer=0, end_layer=layers, kv_dtype=KvDtype.BFLOAT16)
        self.components: list[ComponentSpec] = [
            kv_split_component(self.k, self.v, segments=self.pool),
            flat_component(self.index, layer_ids=self.sparse_layers, segments=self.pool,
                           component=Component.MINIMAX_INDEX_K),
        ]

    def buffers(self) -> list[np.ndarray]:
        return [*self.k, *self.v, *self.index]

    def close(self) -> None:
        self.pool.close()


async def decode_server(broker: BrokerClient, cache: Cache, to_prefill: asyncio.Queue, rng: np.random.Generator
                        ) -> tuple[np.ndarray, object]:
    await broker.register_engine(cache.engine_id, cache.topology, cache.components)
    for buffer in cache.buffers():
        buffer.view(np.uint8)[...] = CANARY
    pages = rng.choice(NUM_PAGES, REQUEST_PAGES, replace=False)  # what the decode allocator handed out
    request_id = "req-1"
    await broker.expect_transfer(cache.engine_id, request_id, pages, components=COMPONENTS, expiry_s=60)
    peer_address = (await broker.info()).peer_address
    await to_prefill.put(Handoff(request_id, cache.engine_id, peer_address, pages))
    status = await broker.wait(cache.engine_id, request_id, timeout=60)
    return pages, status


async def prefill_server(broker: BrokerClient, cache: Cache, from_decode: asyncio.Queue, rng: np.random.Generator
                         ) -> tuple[np.ndarray, object]:
    await broker.register_engine(cache.engine_id, cache.topology, cache.components)
    for buffer in cache.buffers():  # "prefill": the model writes the request's KV
        raw = buffer.view(np.uint8)
        raw[...] = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)
    pages = rng.choice(NUM_PAGES, REQUEST_PAGES, replace=False)  # where prefill computed the request
    handoff: Handoff = await asyncio.wait_for(from_decode.get(), 60)
    status = await broker.transfer(cache.engine_id, handoff.request_id, handoff.peer_address, handoff.engine_id,
                                   pages, components=COMPONENTS, timeout=60)
    return pages, status


def mismatched_bytes(prefill: Cache, decode: Cache, src_pages: np.ndarray, dst_pages: np.ndarray) -> int:
    """Bytes that differ from what the decode cache must hold: the request's pages, canaries elsewhere."""
    bad = 0
    for src, dst in zip(prefill.buffers(), decode.buffers()):
        src_raw = src.view(np.uint8).reshape(NUM_PAGES, -1)
        dst_raw = dst.view(np.uint8).reshape(NUM_PAGES, -1)
        bad += int(np.count_nonzero(dst_raw[dst_pages] != src_raw[src_pages]))
        untouched = np.setdiff1d(np.arange(NUM_PAGES), dst_pages)
        bad += int(np.count_nonzero(dst_raw[untouched] != CANARY))
    return bad


async def run(prefill_target: str, decode_target: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prefill_cache, decode_cache = Cache("prefill-0/tp0"), Cache("decode-0/tp0")
    try:
        async with await BrokerClient.connect(prefill_target) as prefill, \
                await BrokerClient.connect(decode_target) as decode:
            router: asyncio.Queue[Handoff] = asyncio.Queue()
            try:
                (dst_pages, received), (src_pages, sent) = await asyncio.gather(
                    decode_server(decode, decode_cache, router, rng),
                    prefill_server(prefill, prefill_cache, router, rng))
            finally:
                for client, cache in ((prefill, prefill_cache), (decode, decode_cache)):
                    if cache.engine_id in client.registered_engines:
                        await client.unregister_engine(cache.engine_id)
        bad = mismatched_bytes(prefill_cache, decode_cache, src_pages, dst_pages)
    finally:
        prefill_cache.close()
        decode_cache.close()
    return {"pages": sent.pages, "runs": sent.runs, "bytes": sent.bytes, "receiver": received.state.name,
            "mismatched_bytes": bad, "verified": bad == 0}


async def spawn_and_run(seed: int) -> dict:
    from kvbroker.tools.launch import start_broker  # kvbroker's tooling, only to start local brokers

    brokers = await asyncio.gather(start_broker("example-prefill", "--log-level", "WARNING"),
                                   start_broker("example-decode", "--log-level", "WARNING"))
    try:
        return await run(brokers[0].listen, brokers[1].listen, seed)
    finally:
        await asyncio.gather(*(b.stop() for b in brokers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", help="the prefill broker's local API: host:port or unix:/path")
    parser.add_argument("--decode", help="the decode broker's local API")
    parser.add_argument("--spawn", action="store_true", help="start two local brokers for the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.spawn == bool(args.prefill or args.decode) or (not args.spawn and not (args.prefill and args.decode)):
        parser.error("give either --spawn, or both --prefill and --decode")
    result = asyncio.run(spawn_and_run(args.seed) if args.spawn else run(args.prefill, args.decode, args.seed))
    print(f"moved {result['pages']} pages in {result['runs']} runs ({result['bytes']:,} bytes); "
          f"decode saw {result['receiver']}; "
          f"{'every byte verified' if result['verified'] else str(result['mismatched_bytes']) + ' bytes differ'}")
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
