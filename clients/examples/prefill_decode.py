"""A prefill server and a decode server moving one request's KV cache through two kvbroker sidecars.

Uses only the public client (`kvbroker_client`), in the decode-initiated (offered) flow a PD server
runs. Each "server" holds a MiniMax-M3-shaped cache in a SharedPool, as SGLang 0.5.23 lays it out:
MAIN_KV (K and V of the sparse layers), MINIMAX_INDEX_K (the sparse layers' K-only index) and
MINIMAX_DENSE_KV (K and V of the dense layers). The two talk the way a PD router makes them talk:

    prefill  registers; the router learns its broker's peer address and its engine id
    decode   registers, allocates the request's pages (it already holds a cached prefix) and grants
             them, a page list per component, offered to the prefill broker (`expect_transfer`
             with `sender_address`); then tells prefill the request may go (SGLang's metadata frame)
    prefill  sends the main KV after the prefix in chunks (`transfer_part`, one per chunk of chunked
             prefill); the last part adds the index-K suffix, the dense KV of every page, and the
             aux bytes (SGLang's metadata row: first token, cached-token counts, ...)
    decode   waits: SUCCEEDED carries the aux bytes; it checks every byte and every canary

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

DENSE_LAYERS, SPARSE_LAYERS = [0, 1], [2, 3]
NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, INDEX_DIM = 64, 16, 2, 64, 64
REQUEST_PAGES, PREFIX_PAGES = 24, 4  # decode holds the first 4 pages already (its radix cache)
CHUNKS = 3  # parts of the main KV after the prefix, as chunked prefill sends them
CANARY = 0xA5


@dataclass(frozen=True)
class Bootstrap:
    """What the router hands decode about the prefill server (SGLang: its bootstrap server's /route)."""

    peer_address: str  # the prefill broker's peer address
    engine_id: str  # the prefill engine on it


@dataclass(frozen=True)
class Go:
    """What decode tells prefill once its grant is offered (SGLang: the per-request metadata frame)."""

    request_id: str
    prefix_pages: int  # pages decode holds already: prefill sends what comes after them


class Cache:
    """One server's KV cache in shared memory: bf16 K/V per layer, an fp8 K-only index per sparse layer."""

    def __init__(self, engine_id: str) -> None:
        layers = len(DENSE_LAYERS) + len(SPARSE_LAYERS)
        kv_bytes = NUM_PAGES * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
        index_bytes = NUM_PAGES * PAGE_SIZE * INDEX_DIM
        self.engine_id = engine_id
        self.pool = SharedPool(2 * layers * kv_bytes + len(SPARSE_LAYERS) * index_bytes + 64 * 4096,
                               prefix="kvb-example")
        page = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)

        def kv(n: int) -> list[np.ndarray]:
            return [self.pool.numpy(page, np.uint16) for _ in range(n)]  # bf16 bits; numpy has no bfloat16

        self.k, self.v = kv(len(SPARSE_LAYERS)), kv(len(SPARSE_LAYERS))
        self.index = [self.pool.numpy((NUM_PAGES, PAGE_SIZE, INDEX_DIM), np.uint8) for _ in SPARSE_LAYERS]
        self.dense_k, self.dense_v = kv(len(DENSE_LAYERS)), kv(len(DENSE_LAYERS))
        self.topology = Topology(page_size=PAGE_SIZE, start_layer=0, end_layer=layers, kv_dtype=KvDtype.BFLOAT16)
        self.components: list[ComponentSpec] = [
            kv_split_component(self.k, self.v, layer_ids=SPARSE_LAYERS, segments=self.pool),
            flat_component(self.index, layer_ids=SPARSE_LAYERS, segments=self.pool,
                           component=Component.MINIMAX_INDEX_K),
            kv_split_component(self.dense_k, self.dense_v, layer_ids=DENSE_LAYERS, segments=self.pool,
                               component=Component.MINIMAX_DENSE_KV),
        ]

    def buffers(self, component: Component | None = None) -> list[np.ndarray]:
        by_component = {Component.MAIN_KV: [*self.k, *self.v], Component.MINIMAX_INDEX_K: self.index,
                        Component.MINIMAX_DENSE_KV: [*self.dense_k, *self.dense_v]}
        if component is not None:
            return by_component[component]
        return [b for buffers in by_component.values() for b in buffers]

    def close(self) -> None:
        self.pool.close()


def component_pages(pages: np.ndarray, prefix: int) -> dict[Component, np.ndarray]:
    """A request's pages per component, as SGLang 0.5.23 moves them: the main KV and the index K
    after decode's cached prefix, the dense KV of every page."""
    return {Component.MAIN_KV: pages[prefix:], Component.MINIMAX_INDEX_K: pages[prefix:],
            Component.MINIMAX_DENSE_KV: pages}


async def prefill_server(broker: BrokerClient, cache: Cache, router: asyncio.Queue, from_decode: asyncio.Queue,
                         rng: np.random.Generator) -> tuple[np.ndarray, bytes, object]:
    await broker.register_engine(cache.engine_id, cache.topology, cache.components)
    await router.put(Bootstrap((await broker.info()).peer_address, cache.engine_id))
    for buffer in cache.buffers():  # "prefill": the model writes the request's KV
        raw = buffer.view(np.uint8)
        raw[...] = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)
    pages = rng.choice(NUM_PAGES, REQUEST_PAGES, replace=False)  # where prefill computed the request
    go: Go = await asyncio.wait_for(from_decode.get(), 60)
    send = component_pages(pages, go.prefix_pages)
    main = send[Component.MAIN_KV]
    aux = rng.integers(0, 256, 512, dtype=np.uint8).tobytes()  # the first token and metadata, as bytes
    bounds = np.linspace(0, len(main), CHUNKS + 1).astype(int)
    status = None
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        last = i == CHUNKS - 1
        part = {Component.MAIN_KV: main[start:end]}
        if last:  # the states come whole with the last chunk, and the aux bytes with them
            part |= {Component.MINIMAX_INDEX_K: send[Component.MINIMAX_INDEX_K],
                     Component.MINIMAX_DENSE_KV: send[Component.MINIMAX_DENSE_KV]}
        status = await broker.transfer_part(cache.engine_id, go.request_id, part,
                                            dst_offsets={Component.MAIN_KV: int(start)}, last=last,
                                            aux=aux if last else b"", timeout=60)
    return pages, aux, status


async def decode_server(broker: BrokerClient, cache: Cache, router: asyncio.Queue, to_prefill: asyncio.Queue,
                        rng: np.random.Generator) -> tuple[np.ndarray, object]:
    await broker.register_engine(cache.engine_id, cache.topology, cache.components)
    for buffer in cache.buffers():
        buffer.view(np.uint8)[...] = CANARY
    bootstrap: Bootstrap = await asyncio.wait_for(router.get(), 60)
    pages = rng.choice(NUM_PAGES, REQUEST_PAGES, replace=False)  # what the decode allocator handed out
    request_id = "req-1"
    await broker.expect_transfer(cache.engine_id, request_id, component_pages(pages, PREFIX_PAGES),
                                 sender_address=bootstrap.peer_address, sender_engine_id=bootstrap.engine_id,
                                 expiry_s=60)  # returns once the prefill broker holds the offer
    await to_prefill.put(Go(request_id, PREFIX_PAGES))
    status = await broker.wait(cache.engine_id, request_id, timeout=60)
    return pages, status


def mismatched_bytes(prefill: Cache, decode: Cache, src_pages: np.ndarray, dst_pages: np.ndarray) -> int:
    """Bytes that differ from what the decode cache must hold: each component's pages, canaries elsewhere."""
    bad = 0
    src_by, dst_by = component_pages(src_pages, PREFIX_PAGES), component_pages(dst_pages, PREFIX_PAGES)
    for component in src_by:
        untouched = np.setdiff1d(np.arange(NUM_PAGES), dst_by[component])
        for src, dst in zip(prefill.buffers(component), decode.buffers(component)):
            src_raw = src.view(np.uint8).reshape(NUM_PAGES, -1)
            dst_raw = dst.view(np.uint8).reshape(NUM_PAGES, -1)
            bad += int(np.count_nonzero(dst_raw[dst_by[component]] != src_raw[src_by[component]]))
            bad += int(np.count_nonzero(dst_raw[untouched] != CANARY))
    return bad


async def run(prefill_target: str, decode_target: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prefill_cache, decode_cache = Cache("prefill-0/tp0"), Cache("decode-0/tp0")
    try:
        async with await BrokerClient.connect(prefill_target) as prefill, \
                await BrokerClient.connect(decode_target) as decode:
            router: asyncio.Queue[Bootstrap] = asyncio.Queue()
            metadata: asyncio.Queue[Go] = asyncio.Queue()
            try:
                (src_pages, aux, sent), (dst_pages, received) = await asyncio.gather(
                    prefill_server(prefill, prefill_cache, router, metadata, rng),
                    decode_server(decode, decode_cache, router, metadata, rng))
            finally:
                for client, cache in ((prefill, prefill_cache), (decode, decode_cache)):
                    if cache.engine_id in client.registered_engines:
                        await client.unregister_engine(cache.engine_id)
        bad = mismatched_bytes(prefill_cache, decode_cache, src_pages, dst_pages)
    finally:
        prefill_cache.close()
        decode_cache.close()
    return {"pages": sent.pages, "parts": sent.parts, "runs": sent.runs, "bytes": sent.bytes,
            "receiver": received.state.name, "aux_verified": received.aux == aux, "mismatched_bytes": bad,
            "verified": bad == 0 and received.aux == aux}


async def spawn_and_run(seed: int) -> dict:
    from kvbroker_tools.launch import start_broker  # kvbroker's tooling, only to start local brokers

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
    print(f"moved {result['pages']} pages in {result['parts']} parts, {result['runs']} runs ({result['bytes']:,} "
          f"bytes); decode saw {result['receiver']} with {'the' if result['aux_verified'] else 'WRONG'} aux bytes; "
          f"{'every byte verified' if result['verified'] else str(result['mismatched_bytes']) + ' bytes differ'}")
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
