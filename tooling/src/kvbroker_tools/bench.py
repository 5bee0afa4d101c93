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

`run` drives it for the CLI (its arguments are declared in cli.py) and holds the control-plane,
planner and registration sections; the plan and the brokers' sides are bench_setup.py, the data
plane bench_data.py; the children each section starts are bench_children.py; the targets, their
verdicts and the table are bench_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvbroker_tools import shapes
from kvbroker_tools.bench_children import FLOWS, Child
from kvbroker_tools.bench_data import data_plane
from kvbroker_tools.bench_report import judge, machine, render
from kvbroker_tools.bench_setup import QUICK, Plan, Side, open_side
from kvbroker_tools.launch import ChildDied, stopping_on_signals
from kvbroker_tools.shapes import BENCH_CONTROL, BENCH_ENGINE, engine_buffers, page_lists

LOOPS = ("uvloop", "asyncio")


async def control_plane(sides: list[Side], plan: Plan, say) -> dict:
    from kvbroker_client.shm import SharedSegment

    runs, floor, exchange, followed = [], [], [], []
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
                              "decode_metrics": side.decode.metrics_listen,
                              "decode_engine": engines[1], "concurrency": list(plan.concurrency),
                              "seconds": plan.control_seconds, "warmup_s": plan.control_warmup_s,
                              "loop": loop_name, "tag": f"{side.backend}-{loop_name}",
                              "broker_pids": {"prefill_broker": side.prefill.pid, "decode_broker": side.decode.pid}}
                    say(f"control plane: {side.backend}, client on {loop_name}, "
                        f"concurrency {plan.concurrency}")
                    child = await Child.start("control", json.dumps(config))
                    try:
                        per_level = plan.control_seconds + plan.control_warmup_s + 30
                        # + ping, streamed, the two followed ways
                        budget = len(plan.concurrency) * (5 + len(FLOWS)) * per_level + 60
                        report = await child.reply(timeout=budget)
                    finally:
                        await child.stop()
                    for r in report["rpc_floor"]:
                        floor.append({"backend": side.backend, "client_loop": loop_name, **r})
                    exchange += [{"backend": side.backend, "client_loop": loop_name, **r} for r in report["exchange"]]
                    followed += [{"backend": side.backend, "client_loop": loop_name, **r} for r in report["followed"]]
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
                            "then followed and followed_apart, each its own window"},
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
                       "(kvbroker_tools/bench_exchange.py); transfer_ms is the part, ping.call_ms the bare message; "
                       "`unary` repeats the same level's offered row, measured just before",
        "followed": followed,
        "followed_is": "per level, after the exchange rows, on the same streams: the offered flow's one-page request "
                       "with the watches the adapters keep (prefill's end from before the grant, decode's end), as "
                       "`followed` (one message per step: expect_watch, end_watches) and `followed_apart` (the same "
                       "steps as separate commands, as before); messages_per_request: gRPC messages each broker's "
                       "ports read and wrote per request, per port and method, from kvbroker_grpc_messages_total "
                       "(kvbroker_tools/bench_messages.py); threads_per_request: each process's (both brokers', "
                       "the client's) threads' CPU and run-queue delay per request in ms, by thread group, from "
                       "/proc/<pid>/task/<tid>/schedstat over the window (kvbroker_tools/threads.py)",
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
    try:
        return await stopping_on_signals(_bench(args))
    except asyncio.CancelledError:
        print("kvbroker bench: interrupted; brokers stopped and shared memory released", file=sys.stderr)
        return 130


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

