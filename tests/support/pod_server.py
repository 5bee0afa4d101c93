"""An inference server stand-in for the pod tests (tests/deploy/test_pods.py), run in a pod's server
container with the image's own Python (numpy and kvbroker_client; nothing of kvbroker's tooling): it
registers a MiniMax-M3-shaped engine (MAIN_KV, MINIMAX_INDEX_K, MINIMAX_DENSE_KV in /dev/shm, which the
pod's containers share; the example's Cache, clients/examples/prefill_decode.py, mounted at /opt/examples)
with its pod's broker and moves one request, as that example does within one process. The two pods
agree through their settings only: both draw the request's bytes and pages from SEED, so decode checks
every byte without seeing prefill's memory.

    ROLE=prefill  fills its pages, watches for decode's offer, then sends the request in three parts
                  (HOLD=1: never sends, so that decode's request stays in flight)
    ROLE=decode   fills canaries, offers its grant to PREFILL_PEER, waits, checks every byte and canary,
                  prints one JSON line and exits 0 when all matched
Both then stay registered until stopped (unless ONCE=1: a run `podman exec` starts beside the first),
so that the tests can stop a broker or a pod under them. REQUEST names the request (pods-1), EXPIRY_S
its grant's lifetime (120 s), and the
engines are ROLE-REQUEST/tp0, so that a second run registers engines of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

from kvbroker_client import BrokerClient, BrokerError, Component, NotFound, Unavailable

sys.path.insert(0, os.environ.get("EXAMPLES", "/opt/examples"))  # clients/examples, mounted beside this file
from prefill_decode import CANARY, CHUNKS, NUM_PAGES, PREFIX_PAGES, REQUEST_PAGES, Cache  # noqa: E402
from prefill_decode import component_pages as pages_of  # noqa: E402

REQUEST_ID = os.environ.get("REQUEST", "pods-1")
COMPONENTS = (Component.MAIN_KV, Component.MINIMAX_INDEX_K, Component.MINIMAX_DENSE_KV)


def plan(seed: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    """What both pods know of the request: prefill's pages, decode's pages and the aux bytes. Prefill's
    cache bytes come from seed + 1 (fill), buffer by buffer in Cache.buffers' order."""
    rng = np.random.default_rng(seed)
    src = rng.choice(NUM_PAGES, REQUEST_PAGES, replace=False)
    dst = rng.choice(NUM_PAGES, REQUEST_PAGES, replace=False)
    return src, dst, rng.integers(0, 256, 512, dtype=np.uint8).tobytes()


def component_pages(pages: np.ndarray) -> dict[Component, np.ndarray]:
    return pages_of(pages, PREFIX_PAGES)


def fill(cache: Cache, seed: int) -> None:
    rng = np.random.default_rng(seed + 1)
    for component in COMPONENTS:
        for buffer in cache.buffers(component):
            raw = buffer.view(np.uint8)
            raw[...] = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)


async def prefill(broker: BrokerClient, cache: Cache, seed: int, engine_id: str) -> dict:
    fill(cache, seed)
    if os.environ.get("HOLD") == "1":  # registered, and never sends: decode's request stays in flight
        await asyncio.Event().wait()
    src, _, aux = plan(seed)
    send = component_pages(src)
    main = send[Component.MAIN_KV]
    bounds = np.linspace(0, len(main), CHUNKS + 1).astype(int)
    # Decode's offer first, watched for (a broker waits offer_wait_s per watch): a part sent before it
    # came would give up, and the broker would then refuse the late offer (a sender that gave up).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while True:
        try:
            async for _ in broker.watch(engine_id, REQUEST_ID, offer_wait_s=30, timeout=60):
                break  # its first state: the offer is here
            break
        except NotFound:
            if loop.time() > deadline:
                raise
    status = None
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        last = i == CHUNKS - 1
        part = {Component.MAIN_KV: main[start:end]}
        if last:
            part |= {Component.MINIMAX_INDEX_K: send[Component.MINIMAX_INDEX_K],
                     Component.MINIMAX_DENSE_KV: send[Component.MINIMAX_DENSE_KV]}
        status = await broker.transfer_part(engine_id, REQUEST_ID, part, dst_offsets={Component.MAIN_KV: int(start)},
                                            last=last, aux=aux if last else b"", timeout=60)
    return {"role": "prefill", "state": status.state.name, "parts": status.parts}


async def decode(broker: BrokerClient, cache: Cache, seed: int, engine_id: str) -> dict:
    for buffer in cache.buffers():
        buffer.view(np.uint8)[...] = CANARY
    src, dst, aux = plan(seed)
    # A router sends decode a request once prefill serves; the stand-ins start together, so decode offers
    # again while the prefill broker or its engine is not there yet (UNAVAILABLE, NOT_FOUND), bounded.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while True:
        try:
            await broker.expect_transfer(engine_id, REQUEST_ID, component_pages(dst),
                                         sender_address=os.environ["PREFILL_PEER"],
                                         sender_engine_id=f"prefill-{REQUEST_ID}/tp0",
                                         expiry_s=float(os.environ.get("EXPIRY_S", "120")))
            break
        except (NotFound, Unavailable):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)
    print(json.dumps({"offered": REQUEST_ID}), flush=True)  # the grant is live on both brokers
    status = await broker.wait(engine_id, REQUEST_ID, timeout=120)
    bad = mismatched(cache, seed, src, dst)
    return {"role": "decode", "state": status.state.name, "aux_verified": status.aux == aux,
            "mismatched_bytes": bad, "verified": bad == 0 and status.aux == aux}


def mismatched(cache: Cache, seed: int, src: np.ndarray, dst: np.ndarray) -> int:
    """Bytes of decode's cache that differ from what it must hold: prefill's bytes (drawn again from the
    seed, buffer by buffer in the same order) on the granted pages, canaries everywhere else."""
    rng = np.random.default_rng(seed + 1)
    src_by, dst_by = component_pages(src), component_pages(dst)
    bad = 0
    for component in COMPONENTS:
        untouched = np.setdiff1d(np.arange(NUM_PAGES), dst_by[component])
        for buffer in cache.buffers(component):
            raw = buffer.view(np.uint8)
            source = rng.integers(0, 256, size=raw.shape, dtype=np.uint8).reshape(NUM_PAGES, -1)
            got = raw.reshape(NUM_PAGES, -1)
            bad += int(np.count_nonzero(got[dst_by[component]] != source[src_by[component]]))
            bad += int(np.count_nonzero(got[untouched] != CANARY))
    return bad


async def main() -> int:
    role, seed = os.environ["ROLE"], int(os.environ.get("SEED", "0"))
    engine_id = f"{role}-{REQUEST_ID}/tp0"
    cache = Cache(engine_id)
    async with await BrokerClient.connect(os.environ["KVBROKER_ADDRESS"], timeout=60) as broker:
        await broker.register_engine(engine_id, cache.topology, cache.components)
        try:
            report = await (prefill if role == "prefill" else decode)(broker, cache, seed, engine_id)
        except BrokerError as exc:
            report = {"role": role, "error": str(exc), "verified": False}
        print(json.dumps(report), flush=True)
        if os.environ.get("ONCE") == "1":
            return 0 if report.get("verified", True) and "error" not in report else 1
        await asyncio.Event().wait()  # registered until the pod stops
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
