"""The bench's data-plane section (`data_plane`): per backend, one MiniMax-M3-shaped request per size
and fragmentation through two brokers by the public client, beside the engine alone (two Backends in
one child process, and a sender and a receiver in two) and a numpy copy; at one size the same request
also by the offered flow, as one part and in parts (`_parts_case`). The first write of every path is
checked page by page. bench.py's module docstring says what each figure means.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvbroker_tools import shapes
from kvbroker_tools.bench_setup import Plan, Side
from kvbroker_tools.shapes import (
    ALL,
    BENCH_ENGINE,
    PATTERNS,
    MiB,
    fill_random,
    moved_pages_match,
    page_lists,
    sized,
)


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
