"""Load: six rounds of 256 concurrent transfers between two brokers, every page verified, no leak.

Each round moves fresh random bytes from 4 prefill engines to 4 canary-filled decode engines, 64
requests per pair at once (ExpectTransfer, Transfer and a WatchTransfer on every fourth request all
in flight together), with grants that are cancelled and transfers without a grant mixed in. Every
destination byte is checked. Around the rounds, /proc tells each broker's open file descriptors,
threads and resident memory; after the rounds they must be back at the baseline taken after a
warm-up round, and no request may be left live.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from tests.support import flows
from tests.support.brokers import ALL, SMALL, Broker, Engine, Engines, assert_bytes, close_brokers, open_broker
from tests.support.helpers import rpc_refusal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LOAD = dataclasses.replace(SMALL, name="load", num_pages=256, request_pages=4)
PAIRS = 4
REQUESTS_PER_PAIR = LOAD.num_pages // LOAD.request_pages  # 64: every destination page once per round
ROUNDS = 6
CANCELLED_PER_PAIR = 8  # grants that are cancelled instead of transferred
UNGRANTED_PER_PAIR = 8  # transfers that find no grant (NOT_FOUND)
COMPONENT_SETS = [ALL, [pb.COMPONENT_MAIN_KV], [pb.COMPONENT_MINIMAX_INDEX_K]]

# Tolerances, after a warm-up round has made every connection, thread pool, handshake and
# transfer-engine endpoint the load needs. File descriptors and threads come from those, so any
# growth after warm-up is a leak: 2 of slack only for a gRPC or UCX connection being recycled.
# Resident memory moves by about 3 MiB either way between rounds (allocator peaks) and holds by
# design the table's ended records (kept 300 s, ~2 KiB each: ~4 MiB for the ~2000 requests of the
# rounds); 16 MiB above the baseline is a leak of ~8 KiB per request, about what one leaked task
# with its coroutine, call and status objects costs.
FD_SLACK = 2
THREAD_SLACK = 2
RSS_SLACK_KIB = 16 * 1024


@dataclass(frozen=True)
class Usage:
    fds: int
    threads: int
    rss_kib: int


def usage(broker: Broker) -> Usage:
    pid = broker.process.pid
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return Usage(len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"]), int(fields["VmRSS"].split()[0]))


@dataclass(frozen=True)
class Request:
    request_id: str
    src: Engine
    dst: Engine
    components: list[int]
    src_ids: np.ndarray
    dst_ids: np.ndarray


async def grant(r: Request, dst_ids=None) -> None:
    await flows.grant(r.dst, r.request_id, r.dst_ids if dst_ids is None else dst_ids, r.components,
                      expiry_ms=60_000, timeout=60)


async def transfer(r: Request) -> bpb.TransferStatus:
    return (await flows.transfer(r.src, r.dst, r.request_id, r.src_ids, r.components, timeout=90)).status


async def watch(r: Request) -> list[int]:
    return [status.state for status in await flows.watch_all(r.dst, r.request_id, timeout=90)]


async def refused(coro, code: grpc.StatusCode) -> None:
    error = await rpc_refusal(coro)
    assert error.code() == code, error.details()


async def run_round(pairs: list[tuple[Engine, Engine]], number: int) -> None:
    rng = np.random.default_rng(number)
    requests, cancelled, ungranted = [], [], []
    for p, (src, dst) in enumerate(pairs):
        shapes.fill_random(src.segment.array, rng)
        dst.segment.array[:] = shapes.CANARY
        dst_pages = rng.permutation(LOAD.num_pages).reshape(REQUESTS_PER_PAIR, LOAD.request_pages)
        for i in range(REQUESTS_PER_PAIR):
            components = COMPONENT_SETS[int(rng.integers(len(COMPONENT_SETS)))]
            src_ids = rng.choice(LOAD.num_pages, LOAD.request_pages, replace=False)
            requests.append(Request(f"load-{number}-{p}-{i}", src, dst, components, src_ids, dst_pages[i]))
        for i in range(CANCELLED_PER_PAIR):
            cancelled.append(Request(f"cancel-{number}-{p}-{i}", src, dst, ALL, dst_pages[i], dst_pages[i]))
        for i in range(UNGRANTED_PER_PAIR):
            ungranted.append(Request(f"none-{number}-{p}-{i}", src, dst, ALL, dst_pages[i], dst_pages[i]))

    await asyncio.gather(*(grant(r) for r in requests + cancelled))
    watchers = [asyncio.ensure_future(watch(r)) for r in requests[::4]]
    statuses, *_ = await asyncio.gather(
        asyncio.gather(*(transfer(r) for r in requests)),
        *(refused(transfer(r), grpc.StatusCode.NOT_FOUND) for r in ungranted),
        *(r.dst.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=r.dst.engine_id, request_id=r.request_id),
                                    timeout=60) for r in cancelled),
    )
    assert [s.state for s in statuses] == [pb.TRANSFER_STATE_SUCCEEDED] * len(requests)
    for seen in await asyncio.wait_for(asyncio.gather(*watchers), 60):
        assert seen[-1] == pb.TRANSFER_STATE_SUCCEEDED, seen

    for src, dst in pairs:
        expected = np.full_like(dst.segment.array, shapes.CANARY)
        for r in requests:
            if r.dst is dst:
                expected = shapes.expected_destination(src.segment.array, expected, LOAD, dst.placements,
                                                     set(r.components), r.src_ids, r.dst_ids)
        assert_bytes(dst, expected)


async def live_requests(broker: Broker) -> int:
    counts = (await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)).request_counts
    return counts.get("PENDING", 0) - counts.get("SUCCEEDED", 0) - counts.get("FAILED", 0)


async def test_rounds_of_256_concurrent_transfers_verify_every_page_and_leak_nothing(backend):
    prefill = await open_broker(f"load-prefill-{backend}", backend)
    decode = await open_broker(f"load-decode-{backend}", backend)
    engines = Engines()
    try:
        pairs = [(await engines.make(prefill, "prefill", LOAD), await engines.make(decode, "decode", LOAD,
                                                                                     fill="canary"))
                 for _ in range(PAIRS)]
        await run_round(pairs, 0)  # warm-up: connections, handshakes, pools, endpoints
        await asyncio.sleep(0.5)
        baseline = {b.process.broker_id: usage(b) for b in (prefill, decode)}
        started = time.monotonic()
        for number in range(1, ROUNDS + 1):
            await run_round(pairs, number)
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.5)
        after = {b.process.broker_id: usage(b) for b in (prefill, decode)}
        print(f"{ROUNDS} rounds in {elapsed:.1f}s; baseline {baseline}; after {after}")
        for name, before in baseline.items():
            now = after[name]
            assert now.fds <= before.fds + FD_SLACK, f"{name} file descriptors {before.fds} -> {now.fds}"
            assert now.threads <= before.threads + THREAD_SLACK, f"{name} threads {before.threads} -> {now.threads}"
            assert now.rss_kib <= before.rss_kib + RSS_SLACK_KIB, f"{name} RSS {before.rss_kib} -> {now.rss_kib} KiB"
        for broker in (prefill, decode):
            assert await live_requests(broker) == 0, f"requests left live on {broker.process.broker_id}"
    finally:
        await engines.close()
        codes = await close_brokers(prefill, decode)
    assert codes == [0, 0], f"brokers did not shut down cleanly after the load: exit codes {codes}"
