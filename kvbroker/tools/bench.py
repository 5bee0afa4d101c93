"""`kvbroker bench`: what the broker costs over the transfer engine alone, and how fast its parts run.

Sections, each producing plain dicts for the JSON report:
- data plane: per backend, one MiniMax-M3-shaped request per size and fragmentation, moved (a) through
  two broker processes by the public client (client-observed Transfer) and (b) by two Backend
  instances of the same engine in one child process, with the same page lists turned into the same
  descriptors by the same planner; also (c) by a sender and a receiver Backend in two processes,
  because engines move bytes differently within a process than across two, as brokers do. A numpy
  copy of the same bytes is the ceiling. All paths write into the same shared-memory pools and the
  first write of each is checked page by page.
- control plane: one-page Transfer latency and sustained requests/s (grant + transfer) at several
  concurrencies, with the client on uvloop and on asyncio's default loop; brokers run uvloop.
- planner: page ids/s of plan_runs + build_descriptors, against a naive Python loop.
- registration: RegisterEngine / UnregisterEngine of a 64-layer engine with 3 layer buffers a layer.

`run` drives it for the CLI; `TARGETS` are judged in `judge` and printed beside the figures.
Children run as `python -m kvbroker.tools.bench direct|control` and answer in JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import operator
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbroker.tools import shapes
from kvbroker.tools.shapes import (
    ALL,
    BENCH_CONTROL,
    BENCH_ENGINE,
    MiB,
    engine_buffers,
    fill_random,
    moved_pages_match,
    page_lists,
    sized,
)

PATTERNS = ("contiguous", "runs16", "scattered")
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


QUICK = Plan(sizes_mib=(1, 4), repeats=2, concurrency=(1, 16), control_seconds=0.5, control_warmup_s=0.2,
             control_backends=1, planner_sizes=(10**4, 10**5), naive_max=10**4, planner_repeats=2,
             registration_repeats=1, registration_pages=16, op_timeout_s=60.0)


@dataclass(frozen=True)
class Target:
    key: str
    text: str
    threshold: float
    higher_is_better: bool = True

    def met(self, figure: float | None) -> bool | None:
        if figure is None:
            return None
        return figure >= self.threshold if self.higher_is_better else figure <= self.threshold


TARGETS = {
    "ratio": Target("ratio", "broker/direct >= 0.95 at >= 64 MiB", 0.95),
    "runs16": Target("runs16", "runs-of-16 >= 0.8 x contiguous (>= 64 MiB)", 0.8),
    "p50": Target("p50", "one-page Transfer p50 <= 1 ms", 1.0, higher_is_better=False),
    "rps": Target("rps", ">= 2000 req/s at concurrency 128", 2000.0),
    "planner": Target("planner", "planner >= 50M page ids/s at 10^7", 50e6),
}
RATIO_FROM_MIB = 64


# -- children ---------------------------------------------------------------------------------------
class Child:
    """A `python -m kvbroker.tools.bench ...` process: one JSON line in, one JSON line out."""

    def __init__(self, process: asyncio.subprocess.Process, what: str) -> None:
        self.process = process
        self.what = what
        self.timeout = 600.0
        self.stderr: list[str] = []
        self._drain = asyncio.create_task(self._read_stderr())

    @classmethod
    async def start(cls, *args: str) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvbroker.tools.bench", *args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=64 * MiB,
            env={**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")})
        return cls(process, " ".join(args[:1]))

    async def _read_stderr(self) -> None:
        while line := await self.process.stderr.readline():
            self.stderr = (self.stderr + [line.decode(errors="replace").rstrip()])[-40:]

    async def reply(self, timeout: float) -> dict:
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            await asyncio.wait([self._drain], timeout=5)
            raise RuntimeError(f"bench child {self.what} exited:\n" + "\n".join(self.stderr[-20:]))
        answer = json.loads(line)
        if not answer.get("ok", True):
            raise RuntimeError(f"bench child {self.what}: {answer['error']}")
        return answer

    async def ask(self, **command) -> dict:
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()
        return await self.reply(self.timeout)

    async def stop(self) -> None:
        if self.process.returncode is None:
            try:
                self.process.stdin.close()
                await asyncio.wait_for(self.process.wait(), 30)
            except (TimeoutError, ConnectionError):
                self.process.kill()
                await self.process.wait()
        self._drain.cancel()


def _protocol_stream():
    """stdout for our JSON lines only: whatever a library prints goes to stderr instead."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


async def _direct_setup(command: dict, sender, receiver, state: dict) -> dict:
    """Map the pools and register the sides this child plays: both (one process), or one of two.

    A receiver-only child answers with its metadata and its destination pool's address, which the
    parent hands to a sender-only child in another process.
    """
    from kvbroker.registry import Region
    from kvbroker_client.shm import SharedSegment

    shape = shapes.ModelShape(**command["shape"])
    placements = shapes.place_buffers(shape)
    segments = {side: SharedSegment(name, command["size"], create=False)
                for side, name in command["segments"].items()}
    state.update(segments=list(segments.values()), handles=[])
    bases = {side: seg.array.ctypes.data for side, seg in segments.items()}
    if "dst" not in bases:
        bases["dst"] = command["peer"]["dst_base"]
    state["src"], state["dst"] = (engine_buffers(shape, placements, bases[side]) if side in bases else None
                                  for side in ("src", "dst"))
    answer: dict = {}
    if "src" in segments:
        started = time.perf_counter()
        regions = [Region(b.address, b.length, 0, False) for b in state["src"]]
        state["handles"].append((sender, await sender.register(regions)))
        answer.update(register_s=time.perf_counter() - started, regions=len(regions))
    if "dst" in segments:
        regions = [Region(b.address, b.length, 0, False) for b in state["dst"]]
        state["handles"].append((receiver, await receiver.register(regions)))
    if "src" in segments and "dst" in segments:
        state["peer"] = await sender.connect(await receiver.metadata())
    elif "src" in segments:
        state["peer"] = await sender.connect(base64.b64decode(command["peer"]["metadata"]))
    else:
        answer.update(metadata=base64.b64encode(await receiver.metadata()).decode(), dst_base=bases["dst"])
    return answer


async def _direct_child(backend: str) -> None:
    """The engine without a broker: Backend instances the parent drives over stdin, one JSON line each."""
    from kvbroker.backends import create_backend
    from kvbroker.config import Settings
    from kvbroker.planner import build_descriptors, plan_runs

    out = _protocol_stream()
    loop = asyncio.get_running_loop()
    settings = Settings(backend=backend, listen="127.0.0.1:0", peer_listen="127.0.0.1:0")
    sender = create_backend(settings, f"bench-direct-src-{os.getpid()}")
    receiver = create_backend(settings, f"bench-direct-dst-{os.getpid()}")
    await asyncio.gather(sender.start(), receiver.start())
    state: dict = {}
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        try:
            op = command["op"]
            if op == "setup":
                answer = await _direct_setup(command, sender, receiver, state)
            elif op == "plan":
                started = time.perf_counter()
                runs = plan_runs(np.asarray(command["src_ids"]), np.asarray(command["dst_ids"]))
                state["descriptors"] = build_descriptors(runs, state["src"], state["dst"])
                answer = {"plan_s": time.perf_counter() - started, "runs": runs.count,
                          "descriptors": state["descriptors"].count, "bytes": state["descriptors"].nbytes}
            elif op == "write":
                started = time.perf_counter()
                await sender.write(state["peer"], state["descriptors"], timeout=command["timeout"])
                answer = {"seconds": time.perf_counter() - started}
            elif op == "teardown":
                for backend_, handle in state.pop("handles"):
                    await backend_.deregister(handle)
                for segment in state.pop("segments"):
                    segment.close()
                state.clear()
                answer = {}
            else:
                raise ValueError(f"unknown op {op!r}")
            out.write(json.dumps({"ok": True, **answer}) + "\n")
        except Exception as exc:  # the parent reports it and fails the section
            out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
    out.flush()
    os._exit(0)  # NIXL's UCX teardown may crash at interpreter exit; nothing is left to release


@dataclass
class Window:
    """What the control-plane workers saw of one concurrency level; only requests ending inside count."""

    begin: float
    end: float
    transfer_s: list[float] = dataclasses.field(default_factory=list)
    grant_s: list[float] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)


async def _control_worker(config: dict, prefill, decode, window: Window, concurrency: int, w: int) -> None:
    loop = asyncio.get_running_loop()
    i = 0
    while loop.time() < window.end and len(window.errors) <= 100:
        rid = f"cp-{config['tag']}-{concurrency}-{w}-{i}"
        i += 1
        try:
            t0 = time.perf_counter()
            await decode.expect_transfer(config["decode_engine"], rid, [w], components=ALL, expiry_s=60)
            t1 = time.perf_counter()
            await prefill.transfer(config["prefill_engine"], rid, config["peer"], config["decode_engine"],
                                   [w], components=ALL)
            t2 = time.perf_counter()
        except Exception as exc:  # counted and reported; the run goes on
            window.errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if window.begin <= loop.time() <= window.end:
            window.grant_s.append(t1 - t0)
            window.transfer_s.append(t2 - t1)


async def _floor_worker(client, window: Window) -> None:
    """The cheapest broker call (GetBrokerInfo) in a loop: what one unary RPC costs on this stack."""
    loop = asyncio.get_running_loop()
    while loop.time() < window.end:
        started = time.perf_counter()
        await client.info()
        if window.begin <= loop.time() <= window.end:
            window.transfer_s.append(time.perf_counter() - started)


async def _control_child(config: dict) -> dict:
    """Grant + one-page Transfer in a loop from `c` concurrent workers, for each concurrency."""
    from kvbroker_client.client import BrokerClient

    loop = asyncio.get_running_loop()
    prefill = await BrokerClient.connect(config["prefill"])
    decode = await BrokerClient.connect(config["decode"])
    results, floor = [], []
    try:
        for concurrency in config["concurrency"]:
            begin = loop.time() + config["warmup_s"]
            window = Window(begin, begin + config["seconds"])
            cpu, _ = await asyncio.gather(
                _cpu_over(window, config["broker_pids"]),
                asyncio.gather(*(_control_worker(config, prefill, decode, window, concurrency, w)
                                 for w in range(concurrency))))
            requests = len(window.transfer_s)
            results.append({
                "concurrency": concurrency, "requests": requests, "seconds": config["seconds"],
                "requests_per_s": requests / config["seconds"],
                "transfer_ms": _percentiles(np.asarray(window.transfer_s) * 1e3),
                "grant_ms": _percentiles(np.asarray(window.grant_s) * 1e3),
                "errors": len(window.errors), "first_error": window.errors[0] if window.errors else "",
                "cpu_ms_per_request": {k: round(v * 1e3 / max(requests, 1), 4) for k, v in cpu.items()
                                       if k != "machine_busy_cores"},
                "machine_busy_cores": round(cpu["machine_busy_cores"], 2),
            })
        for concurrency in sorted({1, max(config["concurrency"])}):
            begin = loop.time() + config["warmup_s"]
            window = Window(begin, begin + config["seconds"])
            cpu, _ = await asyncio.gather(_cpu_over(window, {"broker": config["broker_pids"]["prefill_broker"]}),
                                          asyncio.gather(*(_floor_worker(prefill, window)
                                                           for _ in range(concurrency))))
            calls = len(window.transfer_s)
            floor.append({"concurrency": concurrency, "calls_per_s": calls / config["seconds"],
                          "call_ms": _percentiles(np.asarray(window.transfer_s) * 1e3),
                          "cpu_ms_per_call": {k: round(v * 1e3 / max(calls, 1), 4) for k, v in cpu.items()
                                              if k != "machine_busy_cores"}})
    finally:
        await prefill.close()
        await decode.close()
    return {"loop": f"{type(loop).__module__}.{type(loop).__name__}", "results": results, "rpc_floor": floor}


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _machine_busy_s() -> float:
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


async def _cpu_over(window: Window, broker_pids: dict[str, int]) -> dict[str, float]:
    """CPU-seconds each broker and this client spent inside the window, and the machine's busy cores."""
    loop = asyncio.get_running_loop()

    def sample() -> dict[str, float]:
        now = {name: _process_cpu_s(pid) for name, pid in broker_pids.items()}
        return {**now, "client": time.process_time(), "machine": _machine_busy_s()}

    await asyncio.sleep(max(0.0, window.begin - loop.time()))
    first = sample()
    await asyncio.sleep(max(0.0, window.end - loop.time()))
    last = sample()
    spent = {k: last[k] - first[k] for k in first}
    spent["machine_busy_cores"] = spent.pop("machine") / (window.end - window.begin)
    return spent


def _percentiles(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": round(float(p50), 4), "p99": round(float(p99), 4), "mean": round(float(values.mean()), 4)}


def _child_main(argv: Sequence[str]) -> None:
    role = argv[0]
    if role == "direct":
        import uvloop

        uvloop.run(_direct_child(argv[1]))  # the brokers' loop
    elif role == "control":
        config = json.loads(argv[1])
        out = _protocol_stream()
        if config["loop"] == "uvloop":
            import uvloop

            report = uvloop.run(_control_child(config))
        else:
            report = asyncio.run(_control_child(config))
        out.write(json.dumps({"ok": True, **report}) + "\n")
        out.flush()
    else:
        raise SystemExit(f"usage: python -m kvbroker.tools.bench direct BACKEND | control CONFIG (got {role!r})")


# -- sections ---------------------------------------------------------------------------------------
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
        for client in (self.p_client, self.d_client):
            await client.close()
        for child in (self.direct, self.direct2_tx, self.direct2_rx):
            if child is not None:
                await child.stop()
        for broker in (self.prefill, self.decode):
            await broker.stop()


async def open_side(backend: str, with_direct: bool, timeout: float) -> Side:
    from kvbroker.tools.launch import start_broker
    from kvbroker_client.client import BrokerClient

    flags = ("--backend", backend, "--log-level", "WARNING", "--transfer-timeout-s", str(timeout))
    started = await asyncio.gather(start_broker(f"bench-prefill-{backend}", *flags),
                                   start_broker(f"bench-decode-{backend}", *flags), return_exceptions=True)
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        for broker in started:
            if not isinstance(broker, BaseException):
                await broker.stop()
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

    cases, memcpy = [], []
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
        await side.d_client.expect_transfer(engines[1], rid, dst_ids, components=ALL, expiry_s=600)
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

    runs, floor = [], []
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
                              "peer": side.decode.peer_listen, "prefill_engine": engines[0],
                              "decode_engine": engines[1], "concurrency": list(plan.concurrency),
                              "seconds": plan.control_seconds, "warmup_s": plan.control_warmup_s,
                              "loop": loop_name, "tag": f"{side.backend}-{loop_name}",
                              "broker_pids": {"prefill_broker": side.prefill.pid, "decode_broker": side.decode.pid}}
                    say(f"control plane: {side.backend}, client on {loop_name}, "
                        f"concurrency {plan.concurrency}")
                    child = await Child.start("control", json.dumps(config))
                    try:
                        per_level = plan.control_seconds + plan.control_warmup_s + 30
                        budget = len(plan.concurrency) * per_level + 60
                        report = await child.reply(timeout=budget)
                    finally:
                        await child.stop()
                    for r in report["rpc_floor"]:
                        floor.append({"backend": side.backend, "client_loop": loop_name, **r})
                    for r in report["results"]:
                        runs.append({"backend": side.backend, "client_loop": loop_name,
                                     "client_loop_class": report["loop"], **r})
                        say(f"  c={r['concurrency']:<4} {r['requests_per_s']:8.0f} req/s, Transfer p50 "
                            f"{r['transfer_ms']['p50']} ms, p99 {r['transfer_ms']['p99']} ms, "
                            f"errors {r['errors']}")
            finally:
                for client, engine_id in ((side.p_client, engines[0]), (side.d_client, engines[1])):
                    await client.unregister_engine(engine_id, timeout=60)
    return {
        "engine": {"layers": BENCH_CONTROL.layers, "layer_buffers": len(placements),
                   "page_bytes": BENCH_CONTROL.request_bytes(1), "components": ["MAIN_KV", "MINIMAX_INDEX_K"]},
        "request": "ExpectTransfer on the decode broker, then Transfer of 1 page on the prefill broker",
        "varied": "the client's event loop (uvloop or asyncio's default), in its own process; "
                  "both brokers always run uvloop (kvbroker serve)",
        "cpu": "cpu_ms_per_request: CPU time each process spent in the window / requests completed in it; "
               "machine_busy_cores: busy time of all CPUs / window (equal to the CPU count when saturated)",
        "runs": runs,
        "rpc_floor": floor,
        "rpc_floor_is": "GetBrokerInfo on the prefill broker through the same client: one unary RPC, no peer",
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
    from kvbroker.planner import build_descriptors, plan_runs

    return build_descriptors(plan_runs(src, dst), src_buffers, dst_buffers)


def _naive_plan_and_build(src: list[int], dst: list[int], src_buffers, dst_buffers):
    return naive_descriptors(naive_plan(src, dst), src_buffers, dst_buffers)


ROW_CAP = 12_000_000  # descriptors per side kept in memory at once (288 MB) for the full-engine build


def planner(plan: Plan, rng: np.random.Generator, say) -> dict:
    from kvbroker.model import BufferLayout, Role
    from kvbroker.planner import plan_runs

    one_src = [BufferLayout(0, Role.K, 1 << 40, 1 << 36, BENCH_ENGINE.kv_item_len)]
    one_dst = [BufferLayout(0, Role.K, 1 << 41, 1 << 36, BENCH_ENGINE.kv_item_len)]
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
        with SharedSegment.create(size, "kvb-bench-reg") as seg:  # never touched: pages stay unallocated
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


# -- targets, report --------------------------------------------------------------------------------
def judge(report: dict) -> list[dict]:
    """One row per target and subject: the figure it is judged on, and whether it is met."""
    verdicts = []

    def add(target: Target, subject: str, figure: float | None, detail: str) -> None:
        verdicts.append({"target": target.key, "text": target.text, "subject": subject,
                         "figure": None if figure is None else round(figure, 4),
                         "threshold": target.threshold, "met": target.met(figure), "detail": detail})

    data = report.get("data_plane")
    if data:
        cases = data["cases"]
        for backend in dict.fromkeys(c["backend"] for c in cases):
            big = [c for c in cases if c["backend"] == backend and c["size_mib"] >= RATIO_FROM_MIB]
            for pattern in PATTERNS:
                mine = [c for c in big if c["pattern"] == pattern]
                for key, baseline in (("ratio", "direct in 1 process"), ("ratio_vs_direct2", "direct in 2")):
                    worst = min(mine, key=operator.itemgetter(key), default=None)
                    add(TARGETS["ratio"], f"{backend} {pattern} vs {baseline}", worst and worst[key],
                        f"lowest over {[c['size_mib'] for c in mine]} MiB"
                        + (f" (at {worst['size_mib']} MiB)" if worst else ": no size >= 64 MiB in this run"))
            for path in ("direct", "broker"):
                pairs = {}
                for c in big:
                    pairs.setdefault(c["size_mib"], {})[c["pattern"]] = c[f"{path}_gbps"]
                fractions = {s: p["runs16"] / p["contiguous"] for s, p in pairs.items()
                             if "runs16" in p and "contiguous" in p}
                worst_size = min(fractions, key=fractions.get, default=None)
                add(TARGETS["runs16"], f"{backend} {path}", fractions.get(worst_size),
                    f"lowest runs16/contiguous GB/s over {sorted(fractions)} MiB"
                    if fractions else "no size >= 64 MiB in this run")
    control = report.get("control_plane")
    if control:
        for r in control["runs"]:
            subject = f"{r['backend']} client {r['client_loop']}"
            if r["concurrency"] == 1:
                add(TARGETS["p50"], subject, r["transfer_ms"]["p50"], f"p99 {r['transfer_ms']['p99']} ms")
            if r["concurrency"] == 128:
                add(TARGETS["rps"], subject, r["requests_per_s"],
                    f"Transfer p50 {r['transfer_ms']['p50']} ms at concurrency 128")
    plans = report.get("planner")
    if plans:
        for row in plans["rows"]:
            if row["pages"] == 10**7:
                add(TARGETS["planner"], f"{row['pattern']} plan_runs+build_descriptors",
                    row["plan_build_1buffer_ids_per_s"],
                    f"one layer-buffer pair; plan_runs alone {row['plan_runs_ids_per_s'] / 1e6:.1f} M ids/s")
    return verdicts


def machine() -> dict:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "kernel": platform.release(), "commit": commit,
        "packages": {n: version(n) for n in ("nixl", "mooncake-transfer-engine-non-cuda",
                                             "mooncake-transfer-engine", "grpcio", "numpy", "uvloop")},
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", ""),
    }


def _fmt_size(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib >= 1024 and mib % 1024 == 0 else f"{mib} MiB"


def _mark(met: bool | None) -> str:
    return {True: "ok", False: "MISS", None: "n/a"}[met]


def _millions(row: dict, key: str) -> str:
    return f"{row[key] / 1e6:.1f}" if key in row else "-"


def _render_data(data: dict) -> list[str]:
    s = data["shape"]
    lines = ["", (f"Data plane: {s['layers']} layers, page_size {s['page_size_tokens']} tokens, "
                  f"{s['layer_buffers']} layer buffers (MAIN_KV K+V bf16 {s['item_len_bytes']['K']} B, "
                  f"MINIMAX_INDEX_K fp8 {s['item_len_bytes']['INDEX_K']} B a page), "
                  f"{s['bytes_per_page'] // 1024} KiB a page; GB/s, median of {data['timing']['repeats']}"),
             (f"{'backend':9}{'size':>8}{'pages':>7} {'pattern':11}{'runs':>6}{'descs':>8}{'broker':>8}"
              f"{'direct':>8}{'2-proc':>8}{'memcpy':>8}  {'broker/direct':19}{'b/2-proc':>9}  "
              f"{'runs16/contig direct|broker':28}")]
    memcpy = {m["size_mib"]: m["gbps"] for m in data["memcpy"]}
    by_key = {(c["backend"], c["size_mib"], c["pattern"]): c for c in data["cases"]}
    for c in data["cases"]:
        big = c["size_mib"] >= RATIO_FROM_MIB
        ratio = f"{c['ratio']:.3f}" + (f" {_mark(TARGETS['ratio'].met(c['ratio']))} >=0.95" if big else "")
        frac = ""
        contig = by_key.get((c["backend"], c["size_mib"], "contiguous"))
        if c["pattern"] == "runs16" and contig:
            d, b = (c[f"{p}_gbps"] / contig[f"{p}_gbps"] for p in ("direct", "broker"))
            frac = f"{d:.3f}|{b:.3f}"
            if big:
                frac += f" {_mark(TARGETS['runs16'].met(min(d, b)))} >=0.8"
        lines.append(f"{c['backend']:9}{_fmt_size(c['size_mib']):>8}{c['pages']:>7} {c['pattern']:11}"
                     f"{c['runs']:>6}{c['descriptors']:>8}{c['broker_gbps']:>8.2f}{c['direct_gbps']:>8.2f}"
                     f"{c.get('direct2_gbps', float('nan')):>8.2f}{memcpy.get(c['size_mib'], 0):>8.2f}  {ratio:19}"
                     f"{c.get('ratio_vs_direct2', float('nan')):>9.3f}  {frac:28}"
                     f"{'' if c['verified'] else 'NOT VERIFIED'}")
    return lines


def _render_control(control: dict) -> list[str]:
    engine = control["engine"]
    lines = ["", (f"Control plane: grant + one-page Transfer ({engine['page_bytes'] // 1024} KiB over "
                  f"{engine['layer_buffers']} layer buffers); varied: the client's loop; brokers on uvloop"),
             (f"{'backend':9}{'client':9}{'conc':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>7}"
              f"{'cpu ms/req P+D+client':>23}{'busy cores':>11}  target")]
    for r in control["runs"]:
        target = ""
        if r["concurrency"] == 1:
            target = f"p50 {_mark(TARGETS['p50'].met(r['transfer_ms']['p50']))} <=1 ms"
        elif r["concurrency"] == 128:
            target = f"req/s {_mark(TARGETS['rps'].met(r['requests_per_s']))} >=2000"
        p50, p99 = (float("nan") if r["transfer_ms"][k] is None else r["transfer_ms"][k]
                    for k in ("p50", "p99"))
        cpu = r.get("cpu_ms_per_request", {})
        split = "+".join(f"{cpu.get(k, float('nan')):.2f}" for k in ("prefill_broker", "decode_broker", "client"))
        lines.append(f"{r['backend']:9}{r['client_loop']:9}{r['concurrency']:>5}{r['requests_per_s']:>9.0f}"
                     f"{p50:>9.3f}{p99:>9.3f}{r['errors']:>7}{split:>23}{r.get('machine_busy_cores', 0):>11.2f}"
                     f"  {target}")
    for f in control.get("rpc_floor", []):
        cpu = f"{f['cpu_ms_per_call'].get('broker', 0):.2f}+{f['cpu_ms_per_call'].get('client', 0):.2f}"
        lines.append(f"{f['backend']:9}{f['client_loop']:9}{f['concurrency']:>5}{f['calls_per_s']:>9.0f}"
                     f"{f['call_ms']['p50'] or float('nan'):>9.3f}{f['call_ms']['p99'] or float('nan'):>9.3f}"
                     f"{'':>7}{cpu + '  ':>23}{'':>11}  floor: one GetBrokerInfo (broker+client cpu)")
    return lines


def _render_planner(plans: dict) -> list[str]:
    full = f"plan_build_{plans['full_engine_buffers']}buffers_ids_per_s"
    lines = ["", (f"Planner: M page ids/s: plan_runs; plan_runs + build_descriptors for 1 layer-buffer pair "
                  f"(build1) and for {plans['full_engine_buffers']} (build192); naive Python loop"),
             (f"{'pages':>10} {'pattern':10}{'runs':>10}{'plan':>8}{'build1':>8}{'build192':>9}"
              f"{'naive':>8}{'naive+b1':>9}  target")]
    for row in plans["rows"]:
        target = ""
        if row["pages"] == 10**7:
            target = f"build1 {_mark(TARGETS['planner'].met(row['plan_build_1buffer_ids_per_s']))} >=50"
        lines.append(f"{row['pages']:>10,} {row['pattern']:10}{row['runs']:>10,}"
                     f"{_millions(row, 'plan_runs_ids_per_s'):>8}"
                     f"{_millions(row, 'plan_build_1buffer_ids_per_s'):>8}"
                     f"{_millions(row, full):>9}{_millions(row, 'naive_plan_ids_per_s'):>8}"
                     f"{_millions(row, 'naive_plan_build_1buffer_ids_per_s'):>9}  {target}")
    return lines


def _render_registration(reg: dict) -> list[str]:
    e = reg["engine"]
    lines = ["", (f"Registration: {e['layers']} layers x 3 = {e['layer_buffers']} layer buffers, "
                  f"{e['pages_per_buffer']} pages each ({e['registered_bytes'] / MiB:.0f} MiB); no target")]
    for row in reg["rows"]:
        lines.append(f"  {row['backend']:9} RegisterEngine {row['register_ms']:.1f} ms, "
                     f"UnregisterEngine {row['unregister_ms']:.1f} ms (median)")
    return lines


def render(report: dict) -> str:
    """The terminal table: every section's figures, each target beside the figure it judges."""
    meta = report["meta"]
    lines = [(f"kvbroker bench{' --quick' if report['quick'] else ''}  {meta['date']}  {meta['host']}  "
              f"{meta['cpus']} CPUs ({meta['cpu']}), {meta['memory_gib']} GiB, "
              f"load {meta['load_avg_at_start']}")]
    for key, part in (("data_plane", _render_data), ("control_plane", _render_control),
                      ("planner", _render_planner), ("registration", _render_registration)):
        if report.get(key):
            lines += part(report[key])
    if report["targets"]:
        lines += ["", "Targets"]
        for v in report["targets"]:
            figure = "-" if v["figure"] is None else f"{v['figure']:,.4g}"
            lines.append(f"  {_mark(v['met']):4} {v['text']:44} {v['subject']:34} {figure:>11}  "
                         f"{v['detail']}")
    if report["errors"]:
        lines += ["", "Errors"] + [f"  {e}" for e in report["errors"]]
    return "\n".join(lines)


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
            await side.close()
    report["targets"] = judge(report)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(render(report), file=table_out, flush=True)
    if args.json:
        print(text, flush=True)
    unverified = [c for c in report.get("data_plane", {}).get("cases", []) if not c["verified"]]
    return 1 if report["errors"] or unverified else 0


if __name__ == "__main__":
    _child_main(sys.argv[1:])
