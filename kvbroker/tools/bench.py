"""`kvbroker bench`: what the broker costs over the transfer engine alone, and how fast its parts run.

Sections, each producing plain dicts for the JSON report:
- data plane: per backend, one MiniMax-M3-shaped request per size and fragmentation, moved (a) through
  two broker processes by the public client (client-observed Transfer) and (b) by two Backend
  instances of the same engine in one child process, with the same page lists turned into the same
  descriptors by the same planner; also (c) by a sender and a receiver Backend in two processes,
  because engines move bytes differently within a process than across two, as brokers do. A numpy
  copy of the same bytes is the ceiling. All paths write into the same shared-memory pools and the
  first write of each is checked page by page. At one size (64 MiB) the same request also goes by
  the offered flow, as one part and as 8 parts one after another, beside the engine alone writing
  the same descriptors at once and in parts.
- control plane: one-page Transfer latency and sustained requests/s (grant + transfer) at several
  concurrencies, the claimed and the offered flow side by side and each against the one-RPC floor
  measured at the same level, with the client on uvloop and on asyncio's default loop; brokers run
  uvloop.
- planner: page ids/s of plan_runs + build_descriptors, against a naive Python loop.
- registration: RegisterEngine / UnregisterEngine of a 64-layer engine with 3 layer buffers a layer.

`run` drives it for the CLI (its arguments are declared in cli.py); the children each section
starts are bench_children.py; the targets, their verdicts and the table are bench_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbroker.tools import shapes
from kvbroker.tools.bench_children import FLOWS, Child
from kvbroker.tools.bench_report import judge, machine, render
from kvbroker.tools.launch import ChildDied, stop_all
from kvbroker.tools.shapes import (
    ALL,
    BENCH_CONTROL,
    BENCH_ENGINE,
    PATTERNS,
    MiB,
    engine_buffers,
    fill_random,
    moved_pages_match,
    page_lists,
    sized,
)

LOOPS = ("uvloop", "asyncio")


@dataclass(frozen=True)
class Plan:
    """How much of each section to run; `quick` keeps all of it under a minute."""

    sizes_mib: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    repeats: int = 5
    warmup: int = 1
    concurrency: tuple[int, ...] = (1, 16, 128)
    control_seconds: float = 4.0
    control_warmup_s: float = 1.0
    control_backends: int = 2  # how many of the backends get the control-plane section
    planner_sizes: tuple[int, ...] = (10**4, 10**5, 10**6, 10**7)
    naive_max: int = 10**6
    planner_repeats: int = 5
    registration_repeats: int = 5
    registration_pages: int = 1024
    op_timeout_s: float = 600.0  # bound on any one transfer or child answer: a hang fails the section
    parts_size_mib: int = 64  # the size whose request is also sent as `parts` parts of the offered flow
    parts: int = 8


QUICK = Plan(sizes_mib=(1, 4), repeats=2, concurrency=(1, 16), control_seconds=0.5, control_warmup_s=0.2,
             control_backends=1, planner_sizes=(10**4, 10**5), naive_max=10**4, planner_repeats=2,
             registration_repeats=1, registration_pages=16, op_timeout_s=60.0, parts_size_mib=4, parts=4)


@dataclass
class Side:
    """One backend's pair of brokers, public clients on them, and its engine-alone children: one that
    plays both sides in one process (`direct`), and a sender and a receiver in two (`direct2`)."""

    backend: str
    prefill: object  # launch.BrokerProcess
    decode: object
    p_client: object  # kvbroker_client.BrokerClient
    d_client: object
    direct: Child | None = None
    direct2_tx: Child | None = None
    direct2_rx: Child | None = None

    async def close(self) -> None:
        """Close all of it, whatever dies on the way; then raise one ChildDied for every child that died."""
        for client in (self.p_client, self.d_client):
            await client.close()
        deaths = []
        for child in (self.direct, self.direct2_tx, self.direct2_rx):
            if child is not None:
                try:
                    await child.stop()
                except ChildDied as exc:
                    deaths.append(str(exc))
        try:
            await stop_all((self.prefill, self.decode))
        except ChildDied as exc:
            deaths.append(str(exc))
        if deaths:
            raise ChildDied("\n".join(deaths))


async def open_side(backend: str, with_direct: bool, timeout: float) -> Side:
    from kvbroker.tools.launch import start_broker
    from kvbroker_client.client import BrokerClient

    flags = ("--backend", backend, "--log-level", "WARNING", "--transfer-timeout-s", str(timeout),
             "--metrics-listen", "127.0.0.1:0")  # scraped only at the control plane's window edges
    started = await asyncio.gather(start_broker(f"bench-prefill-{backend}", *flags),
                                   start_broker(f"bench-decode-{backend}", *flags), return_exceptions=True)
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        await stop_all(b for b in started if not isinstance(b, BaseException))
        raise failed[0]
    prefill, decode = started
    p_client = await BrokerClient.connect(prefill.listen, transfer_timeout=timeout)
    d_client = await BrokerClient.connect(decode.listen, transfer_timeout=timeout)
    side = Side(backend, prefill, decode, p_client, d_client)
    if with_direct:
        side.direct, side.direct2_tx, side.direct2_rx = await asyncio.gather(
            *(Child.start("direct", backend) for _ in range(3)))
        for child in (side.direct, side.direct2_tx, side.direct2_rx):
            child.timeout = timeout
    return side


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


async def data_plane(sides: list[Side], plan: Plan, rng: np.random.Generator, say) -> dict:
    from kvbroker_client.shm import SharedSegment

    cases, memcpy, parts = [], [], []
    for size_mib in plan.sizes_mib:
        shape, pages = sized(size_mib * MiB)
        placements = shapes.place_buffers(shape)
        size = shapes.pool_size(shape, placements)
        say(f"data plane: {size_mib} MiB ({pages} pages, pool {size / MiB:.0f} MiB per side)")
        with SharedSegment.create(size, "kvb-bench-src") as src_seg, \
                SharedSegment.create(size, "kvb-bench-dst") as dst_seg:
            fill_random(src_seg.array, rng)
            dst_seg.array[:] = 0
            nbytes = shape.request_bytes(pages)
            memcpy.append(_memcpy(size_mib, nbytes, src_seg.array, dst_seg.array, plan.repeats + plan.warmup))
            for side in sides:
                engines = (f"bench-src-{size_mib}", f"bench-dst-{size_mib}")
                for client, engine_id, seg in ((side.p_client, engines[0], src_seg),
                                               (side.d_client, engines[1], dst_seg)):
                    request = shapes.register_request(engine_id, shape, seg, placements)
                    await client.register_engine(engine_id, request.topology, list(request.components),
                                                 timeout=120)
                common = {"shape": dataclasses.asdict(shape), "size": size}
                setup = await side.direct.ask(op="setup", segments={"src": src_seg.name, "dst": dst_seg.name},
                                              **common)
                receiver = await side.direct2_rx.ask(op="setup", segments={"dst": dst_seg.name}, **common)
                await side.direct2_tx.ask(op="setup", segments={"src": src_seg.name}, **common,
                                          peer={"metadata": receiver["metadata"], "dst_base": receiver["dst_base"]})
                try:
                    for pattern in PATTERNS:
                        src_ids, dst_ids = page_lists(pattern, pages, shape.num_pages, rng)
                        case = await _one_case(side, plan, shape, placements, src_seg, dst_seg, engines,
                                               pattern, size_mib, src_ids, dst_ids)
                        case["direct_register_s"] = round(setup["register_s"], 6)
                        cases.append(case)
                        say(f"  {side.backend:8} {pattern:10} broker {case['broker_gbps']:.2f} GB/s, "
                            f"direct {case['direct_gbps']:.2f} GB/s (2 processes {case['direct2_gbps']:.2f}), "
                            f"ratio {case['ratio']:.3f}{'' if case['verified'] else '  NOT VERIFIED'}")
                        if size_mib == plan.parts_size_mib:
                            parted = await _parts_case(side, plan, shape, placements, src_seg, dst_seg, engines,
                                                       pattern, size_mib, src_ids, dst_ids)
                            parted.update(claimed_gbps=case["broker_gbps"], direct_gbps=case["direct_gbps"])
                            parts.append(parted)
                            say(f"  {side.backend:8} {pattern:10} offered: 1 part {parted['one_part_gbps']:.2f} "
                                f"GB/s, {plan.parts} parts {parted['parts_gbps']:.2f} GB/s "
                                f"({parted['parts_vs_one']:.3f}){'' if parted['verified'] else '  NOT VERIFIED'}")
                finally:
                    for child in (side.direct, side.direct2_tx, side.direct2_rx):
                        await child.ask(op="teardown")
                    for client, engine_id in ((side.p_client, engines[0]), (side.d_client, engines[1])):
                        await client.unregister_engine(engine_id, timeout=120)
    per_page = {"K": BENCH_ENGINE.kv_item_len, "V": BENCH_ENGINE.kv_item_len, "INDEX_K": BENCH_ENGINE.index_item_len}
    return {
        "shape": {"name": BENCH_ENGINE.name, "layers": BENCH_ENGINE.layers, "dense_layers": BENCH_ENGINE.dense_layers,
                  "sparse_layers": BENCH_ENGINE.sparse_layers, "page_size_tokens": BENCH_ENGINE.page_size,
                  "components": ["MAIN_KV (KV_SPLIT, bf16, 1 KV head x 128)",
                                 "MINIMAX_INDEX_K (FLAT, fp8, 128) on every sparse layer"],
                  "layer_buffers": len(shapes.place_buffers(BENCH_ENGINE)), "item_len_bytes": per_page,
                  "bytes_per_page": BENCH_ENGINE.request_bytes(1)},
        "patterns": {"contiguous": "one run", "runs16": "runs of 16 pages, shuffled, both sides",
                     "scattered": "every page its own run (random permutations)"},
        "timing": {"broker": "client-observed BrokerClient.transfer (grant issued beforehand)",
                   "direct": "Backend.write, sender and receiver Backend in one process, same descriptors",
                   "direct2": "Backend.write, sender and receiver Backend in two processes (as the brokers are)",
                   "statistic": "median", "repeats": plan.repeats, "repeats_from_1_gib": min(plan.repeats, 3),
                   "warmup": plan.warmup, "order": "broker, direct and direct2 alternate within each repeat"},
        "cases": cases, "memcpy": memcpy,
        "parts": {"size_mib": plan.parts_size_mib, "parts": plan.parts, "cases": parts,
                  "timing": "offered flow through the brokers, on the engines and page lists of the case above: "
                            "the offer is made before the clock starts; one part: its Transfer call; parts: the "
                            "first part's call to the last one's return, one after another (as chunked prefill "
                            "sends them), each part a contiguous slice of every component's page list; "
                            "1 part and n parts alternate within each repeat, median",
                  "claimed_gbps": "the case's broker figure: the same request by the claimed flow, one Transfer",
                  "direct2": "the engine alone (sender and receiver Backend in two processes), the same "
                             "descriptors written at once or part after part, timed after each broker request"},
    }


async def _one_case(side: Side, plan: Plan, shape, placements, src_seg, dst_seg, engines, pattern: str,
                    size_mib: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> dict:
    planned = await side.direct.ask(op="plan", src_ids=src_ids.tolist(), dst_ids=dst_ids.tolist())
    await side.direct2_tx.ask(op="plan", src_ids=src_ids.tolist(), dst_ids=dst_ids.tolist())
    broker_s, direct_s, direct2_s, duration_us = [], [], [], []
    verified, status = True, None
    repeats = plan.repeats if size_mib < 1024 else min(plan.repeats, 3)  # a GiB scattered takes seconds
    for rep in range(plan.warmup + repeats):
        first = rep == 0
        if first:
            dst_seg.array[:] = 0
        rid = f"bench-{side.backend}-{size_mib}-{pattern}-{rep}"
        await side.d_client.expect_transfer(engines[1], rid, dst_page_ids=dst_ids, components=ALL, expiry_s=600)
        started = time.perf_counter()
        status = await side.p_client.transfer(engines[0], rid, side.decode.peer_listen, engines[1], src_ids,
                                              components=ALL)
        elapsed = time.perf_counter() - started
        if first:
            verified &= moved_pages_match(shape, placements, src_seg.array, dst_seg.array, src_ids, dst_ids)
            dst_seg.array[:] = 0
        direct = (await side.direct.ask(op="write", timeout=plan.op_timeout_s))["seconds"]
        if first:
            verified &= moved_pages_match(shape, placements, src_seg.array, dst_seg.array, src_ids, dst_ids)
            dst_seg.array[:] = 0
        direct2 = (await side.direct2_tx.ask(op="write", timeout=plan.op_timeout_s))["seconds"]
        if first:
            verified &= moved_pages_match(shape, placements, src_seg.array, dst_seg.array, src_ids, dst_ids)
        if rep >= plan.warmup:
            broker_s.append(elapsed)
            direct_s.append(direct)
            direct2_s.append(direct2)
            duration_us.append(status.duration_us)
    nbytes = planned["bytes"]
    broker_gbps, direct_gbps = _median_gbps(nbytes, broker_s), _median_gbps(nbytes, direct_s)
    direct2_gbps = _median_gbps(nbytes, direct2_s)
    return {
        "backend": side.backend, "size_mib": size_mib, "pattern": pattern, "pages": int(src_ids.size),
        "layers": shape.layers, "page_size_tokens": shape.page_size, "bytes": nbytes, "runs": planned["runs"],
        "descriptors": planned["descriptors"], "broker_runs": status.runs, "broker_bytes": status.bytes,
        "broker_s": [round(s, 6) for s in broker_s], "direct_s": [round(s, 6) for s in direct_s],
        "direct2_s": [round(s, 6) for s in direct2_s], "direct2_gbps": round(direct2_gbps, 4),
        "ratio_vs_direct2": round(broker_gbps / direct2_gbps, 4),
        "broker_duration_us_median": int(statistics.median(duration_us)),
        "broker_gbps": round(broker_gbps, 4), "direct_gbps": round(direct_gbps, 4),
        "broker_overhead_ms": round((statistics.median(broker_s) - statistics.median(direct_s)) * 1e3, 3),
        "ratio": round(broker_gbps / direct_gbps, 4), "direct_plan_s": round(planned["plan_s"], 6),
        "verified": bool(verified and status.bytes == nbytes and status.runs == planned["runs"]),
    }


async def _parts_case(side: Side, plan: Plan, shape, placements, src_seg, dst_seg, engines, pattern: str,
                      size_mib: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> dict:
    """The offered flow: the request as one part, and as `plan.parts` parts sent one after another."""
    from kvbroker_client.model import TransferState

    bounds = np.linspace(0, src_ids.size, plan.parts + 1).astype(int)
    await side.direct2_tx.ask(op="plan_parts", src_ids=src_ids.tolist(), dst_ids=dst_ids.tolist(),
                              bounds=bounds.tolist())
    one_s, parts_s, verified, nbytes = [], [], True, shape.request_bytes(int(src_ids.size))
    direct2 = {1: [], plan.parts: []}  # the engine alone, two processes: the same writes, one or in parts
    repeats = plan.repeats if size_mib < 1024 else min(plan.repeats, 3)
    for rep in range(plan.warmup + repeats):
        for split in ((1, plan.parts) if rep % 2 == 0 else (plan.parts, 1)):
            first = rep == 0
            if first:
                dst_seg.array[:] = 0
            rid = f"bench-parts-{side.backend}-{size_mib}-{pattern}-{rep}-{split}"
            await side.d_client.expect_transfer(engines[1], rid, {c: dst_ids for c in ALL},
                                                sender_address=side.prefill.peer_listen,
                                                sender_engine_id=engines[0], expiry_s=600)
            cuts = bounds if split > 1 else np.array([0, src_ids.size])
            started = time.perf_counter()
            for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
                status = await side.p_client.transfer_part(engines[0], rid, {c: src_ids[a:b] for c in ALL},
                                                           dst_offsets={c: int(a) for c in ALL},
                                                           last=i == len(cuts) - 2, timeout=plan.op_timeout_s)
            elapsed = time.perf_counter() - started
            verified &= status.state is TransferState.SUCCEEDED and status.parts == split and status.bytes == nbytes
            if first:
                verified &= moved_pages_match(shape, placements, src_seg.array, dst_seg.array, src_ids, dst_ids)
            engine_s = (await side.direct2_tx.ask(op="write", parts=split > 1, timeout=plan.op_timeout_s))["seconds"]
            if rep >= plan.warmup:
                (one_s if split == 1 else parts_s).append(elapsed)
                direct2[split].append(engine_s)
    one_gbps, parts_gbps = _median_gbps(nbytes, one_s), _median_gbps(nbytes, parts_s)
    engine_one, engine_parts = (statistics.median(direct2[k]) for k in (1, plan.parts))
    return {
        "backend": side.backend, "size_mib": size_mib, "pattern": pattern, "pages": int(src_ids.size),
        "bytes": nbytes, "parts": plan.parts, "part_pages": np.diff(bounds).tolist(),
        "one_part_s": [round(x, 6) for x in one_s], "parts_s": [round(x, 6) for x in parts_s],
        "one_part_gbps": round(one_gbps, 4), "parts_gbps": round(parts_gbps, 4),
        "parts_vs_one": round(parts_gbps / one_gbps, 4),
        "extra_ms_per_part": round((statistics.median(parts_s) - statistics.median(one_s)) * 1e3
                                   / (plan.parts - 1), 3),
        "direct2_one_s": [round(x, 6) for x in direct2[1]],
        "direct2_parts_s": [round(x, 6) for x in direct2[plan.parts]],
        "direct2_one_gbps": round(nbytes / engine_one / 1e9, 4),
        "direct2_parts_gbps": round(nbytes / engine_parts / 1e9, 4),
        "direct2_extra_ms_per_part": round((engine_parts - engine_one) * 1e3 / (plan.parts - 1), 3),
        "verified": bool(verified),
    }


def _memcpy(size_mib: int, nbytes: int, src: np.ndarray, dst: np.ndarray, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst[:nbytes], src[:nbytes])
        seconds.append(time.perf_counter() - started)
    return {"size_mib": size_mib, "bytes": nbytes, "gbps": round(_median_gbps(nbytes, seconds), 4),
            "seconds": [round(s, 6) for s in seconds]}


async def control_plane(sides: list[Side], plan: Plan, say) -> dict:
    from kvbroker_client.shm import SharedSegment

    runs, floor, exchange = [], [], []
    placements = shapes.place_buffers(BENCH_CONTROL)
    size = shapes.pool_size(BENCH_CONTROL, placements)
    for side in sides:
        with SharedSegment.create(size, "kvb-bench-cp-src") as src_seg, \
                SharedSegment.create(size, "kvb-bench-cp-dst") as dst_seg:
            engines = ("bench-cp-src", "bench-cp-dst")
            for client, engine_id, seg in ((side.p_client, engines[0], src_seg),
                                           (side.d_client, engines[1], dst_seg)):
                request = shapes.register_request(engine_id, BENCH_CONTROL, seg, placements)
                await client.register_engine(engine_id, request.topology, list(request.components),
                                             timeout=60)
            try:
                for loop_name in LOOPS:
                    config = {"prefill": side.prefill.listen, "decode": side.decode.listen,
                              "peer": side.decode.peer_listen, "prefill_peer": side.prefill.peer_listen,
                              "prefill_metrics": side.prefill.metrics_listen, "prefill_engine": engines[0],
                              "decode_engine": engines[1], "concurrency": list(plan.concurrency),
                              "seconds": plan.control_seconds, "warmup_s": plan.control_warmup_s,
                              "loop": loop_name, "tag": f"{side.backend}-{loop_name}",
                              "broker_pids": {"prefill_broker": side.prefill.pid, "decode_broker": side.decode.pid}}
                    say(f"control plane: {side.backend}, client on {loop_name}, "
                        f"concurrency {plan.concurrency}")
                    child = await Child.start("control", json.dumps(config))
                    try:
                        per_level = plan.control_seconds + plan.control_warmup_s + 30
                        budget = len(plan.concurrency) * (3 + len(FLOWS)) * per_level + 60  # + ping, streamed
                        report = await child.reply(timeout=budget)
                    finally:
                        await child.stop()
                    for r in report["rpc_floor"]:
                        floor.append({"backend": side.backend, "client_loop": loop_name, **r})
                    exchange += [{"backend": side.backend, "client_loop": loop_name, **r} for r in report["exchange"]]
                    for r in report["results"]:
                        runs.append({"backend": side.backend, "client_loop": loop_name,
                                     "client_loop_class": report["loop"], **r})
                        say(f"  {r['flow']:8} c={r['concurrency']:<4} {r['requests_per_s']:8.0f} req/s, "
                            f"Transfer p50 {r['transfer_ms']['p50']} ms ({r.get('transfer_p50_vs_floor')}x "
                            f"the floor), p99 {r['transfer_ms']['p99']} ms, errors {r['errors']}")
            finally:
                for client, engine_id in ((side.p_client, engines[0]), (side.d_client, engines[1])):
                    await client.unregister_engine(engine_id, timeout=60)
    return {
        "engine": {"layers": BENCH_CONTROL.layers, "layer_buffers": len(placements),
                   "page_bytes": BENCH_CONTROL.request_bytes(1), "components": ["MAIN_KV", "MINIMAX_INDEX_K"]},
        "request": "ExpectTransfer on the decode broker, then Transfer of 1 page on the prefill broker",
        "flows": {"claimed": "ExpectTransfer(components, dst_page_ids); Transfer(peer_address, remote_engine_id, "
                             "src_page_ids): the sender claims the grant (ClaimGrant), writes, CompleteTransfer",
                  "offered": "ExpectTransfer(pages, sender_address, sender_engine_id) offers the grant to the "
                             "prefill broker before it returns; Transfer(pages, last) writes one part and sends "
                             "one NotifyParts notice (batched per peer)"},
        "timing": {"transfer_ms": "the prefill server's Transfer call, to its return (the critical path); "
                                  "the offer is made before it, outside this figure",
                   "grant_ms": "the decode server's ExpectTransfer (offered: with the offer delivered)",
                   "request_ms": "grant + Transfer, one request's whole time",
                   "requests_per_s": "whole requests (grant + Transfer) completed in the window per second",
                   "order": "per concurrency level: floor, claimed, offered, then (exchange) ping and streamed, "
                            "each its own window"},
        "notify": "offered rows: the prefill broker's NotifyParts calls and notices in the window "
                  "(kvbroker_peer_notify_calls_total, kvbroker_peer_part_notices_total)",
        "varied": "the client's event loop (uvloop or asyncio's default), in its own process; "
                  "both brokers always run uvloop (kvbroker serve)",
        "cpu": "cpu_ms_per_request: CPU time each process spent in the window / requests completed in it; "
               "machine_busy_cores: busy time of all CPUs / window (equal to the CPU count when saturated)",
        "runs": runs,
        "exchange": exchange,
        "exchange_is": "per level: a bare message (ping) on the prefill client's Exchange stream, then the offered "
                       "flow's request with its ExpectTransfer and its part as commands on the two clients' streams "
                       "(kvbroker/tools/bench_exchange.py); transfer_ms is the part, ping.call_ms the bare message; "
                       "`unary` repeats the same level's offered row, measured just before",
        "rpc_floor": floor,
        "rpc_floor_is": "GetBrokerInfo on the prefill broker through the same client: one unary RPC, no peer; "
                        "measured at every concurrency level, just before that level's flows",
    }


def naive_plan(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:]):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def naive_descriptors(runs, src_buffers, dst_buffers) -> tuple[list, list]:
    src_rows, dst_rows = [], []
    for sb, db in zip(src_buffers, dst_buffers):
        for s, d, n in runs:
            src_rows.append((sb.address + s * sb.item_len, n * sb.item_len, sb.device))
            dst_rows.append((db.address + d * db.item_len, n * db.item_len, db.device))
    return src_rows, dst_rows


def _median_seconds(repeats: int, fn: Callable, *args) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _plan_and_build(src: np.ndarray, dst: np.ndarray, src_buffers, dst_buffers):
    from kvbroker.core.planner import build_descriptors, plan_runs

    return build_descriptors(plan_runs(src, dst), src_buffers, dst_buffers)


def _naive_plan_and_build(src: list[int], dst: list[int], src_buffers, dst_buffers):
    return naive_descriptors(naive_plan(src, dst), src_buffers, dst_buffers)


ROW_CAP = 12_000_000  # descriptors per side kept in memory at once (288 MB) for the full-engine build


def planner(plan: Plan, rng: np.random.Generator, say) -> dict:
    from kvbroker.core.model import BufferLayout, BufferRole
    from kvbroker.core.planner import plan_runs

    one_src = [BufferLayout(0, BufferRole.K, 1 << 40, 1 << 36, BENCH_ENGINE.kv_item_len)]
    one_dst = [BufferLayout(0, BufferRole.K, 1 << 41, 1 << 36, BENCH_ENGINE.kv_item_len)]
    placements = shapes.place_buffers(BENCH_ENGINE)
    full_src = engine_buffers(BENCH_ENGINE, placements, 1 << 40)
    full_dst = engine_buffers(BENCH_ENGINE, placements, 1 << 42)
    full_key = f"plan_build_{len(full_src)}buffers_ids_per_s"
    rows = []
    for n in plan.planner_sizes:
        for pattern in ("runs16", "scattered"):
            src, dst = page_lists(pattern, n, math.ceil(n / 16) * 16, rng)
            runs = plan_runs(src, dst)
            repeats = plan.planner_repeats if n <= 10**6 else max(2, plan.planner_repeats // 2)
            row = {"pages": n, "pattern": pattern, "runs": runs.count,
                   "plan_runs_ids_per_s": n / _median_seconds(repeats, plan_runs, src, dst),
                   "plan_build_1buffer_ids_per_s":
                       n / _median_seconds(repeats, _plan_and_build, src, dst, one_src, one_dst)}
            if runs.count * len(full_src) <= ROW_CAP:
                row[full_key] = n / _median_seconds(repeats, _plan_and_build, src, dst, full_src, full_dst)
            if n <= plan.naive_max:
                s_list, d_list = src.tolist(), dst.tolist()
                naive_repeats = plan.planner_repeats if n <= 10**5 else 1
                row["naive_plan_ids_per_s"] = n / _median_seconds(naive_repeats, naive_plan, s_list, d_list)
                row["naive_plan_build_1buffer_ids_per_s"] = n / _median_seconds(
                    naive_repeats, _naive_plan_and_build, s_list, d_list, one_src, one_dst)
            rows.append({k: (round(v) if isinstance(v, float) else v) for k, v in row.items()})
            say(f"planner: {n:>9,} ids {pattern:9} plan+build(1 buffer) "
                f"{rows[-1]['plan_build_1buffer_ids_per_s'] / 1e6:.1f} M ids/s")
    return {"input": "int64 numpy arrays (the broker's form after page_ids_in)",
            "statistic": "median of repeats (naive: one run above 10^5 pages)",
            "full_engine_buffers": len(full_src), "full_engine_row_cap": ROW_CAP, "rows": rows}


async def registration(sides: list[Side], plan: Plan, say) -> dict:
    from kvbroker_client.shm import SharedSegment

    shape = dataclasses.replace(BENCH_ENGINE, num_pages=plan.registration_pages)
    placements = shapes.place_buffers(shape)
    size = shapes.pool_size(shape, placements)
    rows = []
    for side in sides:
        register_s, unregister_s = [], []
        with SharedSegment.create(size, "kvb-bench-reg") as seg:  # allocated at creation, as servers should
            for rep in range(plan.registration_repeats):
                engine_id = f"bench-reg-{rep}"
                request = shapes.register_request(engine_id, shape, seg, placements)
                started = time.perf_counter()
                await side.p_client.register_engine(engine_id, request.topology, list(request.components),
                                                    timeout=120)
                register_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                await side.p_client.unregister_engine(engine_id, timeout=120)
                unregister_s.append(time.perf_counter() - started)
        rows.append({"backend": side.backend, "register_ms": round(statistics.median(register_s) * 1e3, 3),
                     "unregister_ms": round(statistics.median(unregister_s) * 1e3, 3),
                     "register_ms_all": [round(s * 1e3, 3) for s in register_s]})
        say(f"registration: {side.backend} {rows[-1]['register_ms']} ms register, "
            f"{rows[-1]['unregister_ms']} ms unregister")
    return {"engine": {"layers": shape.layers, "layer_buffers": len(placements),
                       "components": "MAIN_KV K + V (bf16) and MINIMAX_INDEX_K (fp8) on each of 64 layers",
                       "pages_per_buffer": shape.num_pages, "registered_bytes": shape.pool_bytes},
            "timing": "client-observed RegisterEngine / UnregisterEngine on one broker, median",
            "rows": rows}


def _available(backend: str) -> bool:
    module = {"nixl": "nixl", "mooncake": "mooncake"}.get(backend)
    return module is not None and importlib.util.find_spec(module) is not None


async def run(args: argparse.Namespace) -> int:
    """The CLI's entry: SIGINT/SIGTERM stop the brokers and children and release the shared memory."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    try:
        return await _bench(args)
    except asyncio.CancelledError:
        print("kvbroker bench: interrupted; brokers stopped and shared memory released", file=sys.stderr)
        return 130
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _bench(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else Plan()
    if args.sizes:
        plan = dataclasses.replace(plan, sizes_mib=tuple(int(s) for s in args.sizes.split(",")))
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"data", "control", "planner", "registration"}
    if unknown:
        print(f"kvbroker bench: unknown sections {sorted(unknown)}", file=sys.stderr)
        return 2
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends = [b for b in wanted if _available(b)]
    table_out = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    rng = np.random.default_rng(args.seed)
    report: dict = {"meta": machine(), "quick": args.quick, "plan": dataclasses.asdict(plan),
                    "backends": backends, "skipped_backends": [b for b in wanted if b not in backends],
                    "sections": sections, "errors": []}
    seconds = report["section_seconds"] = {}
    if "planner" in sections:
        started = time.perf_counter()
        report["planner"] = planner(plan, rng, say)
        seconds["planner"] = round(time.perf_counter() - started, 2)
    sides: list[Side] = []
    try:
        if {"data", "control", "registration"} & set(sections):
            started = time.perf_counter()
            opened = await asyncio.gather(
                *(open_side(b, "data" in sections, plan.op_timeout_s) for b in backends), return_exceptions=True)
            sides = [side for side in opened if isinstance(side, Side)]
            for failure in (o for o in opened if not isinstance(o, Side)):
                raise failure
            seconds["start_brokers"] = round(time.perf_counter() - started, 2)
        for name, section in (("data", lambda: data_plane(sides, plan, rng, say)),
                              ("control", lambda: control_plane(sides[:plan.control_backends], plan, say)),
                              ("registration", lambda: registration(sides, plan, say))):
            if name not in sections:
                continue
            started = time.perf_counter()
            try:
                report[{"data": "data_plane", "control": "control_plane"}.get(name, name)] = await section()
            except Exception as exc:  # one failed section is reported; the others still run
                report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                say(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            seconds[name] = round(time.perf_counter() - started, 2)
    finally:
        for side in sides:
            try:
                await side.close()
            except ChildDied as exc:  # reported; the other sides are still closed
                report["errors"].append(f"close {side.backend}: {exc}")
                say(f"close {side.backend}: FAILED: {exc}")
    report["targets"] = judge(report)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(render(report), file=table_out, flush=True)
    if args.json:
        print(text, flush=True)
    data = report.get("data_plane", {})
    unverified = [c for c in data.get("cases", []) + data.get("parts", {}).get("cases", []) if not c["verified"]]
    return 1 if report["errors"] or unverified else 0

