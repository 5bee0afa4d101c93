"""What memory safety costs (kvbroker/memory/mapping.py): reservation at registration, the per-write check,
absorbing a SIGBUS. JSON on stdout (or --out), a summary on stderr.

    scripts/in-netns.sh .venv/bin/python benchmarks/memsafe.py --out benchmarks/out/memsafe.json

- reserve: map_shared_memory + MappedSegment.reserve of every layer buffer of the benchmark's
  192-buffer engine (kvbroker bench's, 640 MiB at 1024 pages) + close, in this process, for a
  segment its server allocated (posix_fallocate, as kvbroker_client does) and for a sparse one
  (ftruncate only: the broker allocates it); `map_only` is the same without reserve, the old path.
- register: client-observed RegisterEngine / UnregisterEngine of that engine on one broker per
  backend, over an allocated and over a sparse segment (a fresh one each repeat).
- check: check_segments of an engine with one segment (what each of the five checks around a
  transfer costs), and one fstat for comparison.
- guard: a thread's write into a 1 GiB mapping truncated under it: the first touch takes the fault
  and the guard replaces the whole mapping; the rest of the write runs on zero pages.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbroker_tools import shapes  # noqa: E402

SHM = Path("/dev/shm")
# kvbroker bench's registration engine: 64 layers of MAIN_KV K and V (bf16, 4096 B a page) and
# MINIMAX_INDEX_K (fp8, 2048 B a page), 192 layer buffers, 640 KiB a page over the model.
ENGINE = shapes.ModelShape("m3-bench", dense_layers=0, sparse_layers=64, page_size=16, kv_heads=1, head_dim=128,
                         kv_bytes=2, index_head_dim=128, index_bytes=1, num_pages=1024, request_pages=1)


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def new_segment(size: int, *, allocate: bool) -> Path:
    path = SHM / f"kvb-memsafe-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if allocate:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return path


def reserve_section(shape: shapes.ModelShape, repeats: int) -> dict:
    from kvbroker.memory.mapping import map_shared_memory

    placements = shapes.place_buffers(shape)
    size = shapes.pool_size(shape, placements)
    spans = [(p.offset, shape.num_pages * p.item_len) for p in placements]
    rows = []
    for state in ("allocated", "sparse"):
        for mode in ("map_only", "reserve"):
            samples = []
            reused = new_segment(size, allocate=True) if state == "allocated" else None
            for _ in range(repeats):
                path = reused or new_segment(size, allocate=False)
                started = time.perf_counter()
                seg = map_shared_memory(path.name, "bench")
                if mode == "reserve":
                    for offset, length in spans:
                        seg.reserve(offset, length, "bench")
                seg.close()
                samples.append(time.perf_counter() - started)
                if reused is None:
                    path.unlink()
            if reused is not None:
                reused.unlink()
            rows.append({"segment": state, "mode": mode, "ms": median_ms(samples),
                         "ms_all": [round(s * 1e3, 3) for s in samples]})
    return {"bytes": size, "layer_buffers": len(spans), "timing": "in-process, median", "rows": rows}


async def register_section(shape: shapes.ModelShape, repeats: int, backends: list[str]) -> dict:
    import grpc

    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
    from kvbroker_tools.launch import start_broker

    placements = shapes.place_buffers(shape)
    size = shapes.pool_size(shape, placements)
    rows = []
    for backend in backends:
        broker = await start_broker(f"memsafe-{backend}", "--backend", backend, "--log-level", "ERROR")
        try:
            async with grpc.aio.insecure_channel(broker.listen) as channel:
                stub = bpb_grpc.BrokerServiceStub(channel)
                for state in ("allocated", "sparse"):
                    register_s, unregister_s = [], []
                    reused = new_segment(size, allocate=True) if state == "allocated" else None
                    for rep in range(repeats):
                        path = reused or new_segment(size, allocate=False)
                        segment = types.SimpleNamespace(name=path.name)
                        engine_id = f"memsafe-{state}-{rep}"
                        request = shapes.register_request(engine_id, shape, segment, placements)
                        started = time.perf_counter()
                        await stub.RegisterEngine(request, timeout=120)
                        register_s.append(time.perf_counter() - started)
                        started = time.perf_counter()
                        await stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=engine_id), timeout=120)
                        unregister_s.append(time.perf_counter() - started)
                        if reused is None:
                            path.unlink()
                    if reused is not None:
                        reused.unlink()
                    rows.append({"backend": backend, "segment": state, "register_ms": median_ms(register_s),
                                 "unregister_ms": median_ms(unregister_s),
                                 "register_ms_all": [round(s * 1e3, 3) for s in register_s]})
        finally:
            await broker.stop()
    return {"bytes": size, "layer_buffers": len(placements),
            "timing": "client-observed RegisterEngine / UnregisterEngine on one broker, median", "rows": rows}


def check_section(calls: int) -> dict:
    from kvbroker.memory.mapping import check_segments, map_shared_memory

    path = new_segment(1 << 20, allocate=True)
    seg = map_shared_memory(path.name, "bench")
    seg.reserve(0, 1 << 20, "bench")
    held = [seg]
    try:
        fd = seg._fd
        rows = {}
        for name, call in (("check_segments", lambda: check_segments(held, "bench/tp0")),
                           ("fstat", lambda: os.fstat(fd))):
            best = []
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(calls):
                    call()
                best.append((time.perf_counter() - started) / calls)
            rows[f"{name}_us"] = round(statistics.median(best) * 1e6, 3)
    finally:
        seg.close()
        path.unlink()
    return {"calls_per_repeat": calls, "timing": "in-process loop, median of 5 repeats, per call",
            "checks_per_transfer": "sender: Transfer, before the write, after it; receiver: claim, complete "
                                   "(+ ExpectTransfer per grant)", **rows}


GUARD_CHILD = textwrap.dedent("""
    import ctypes, json, os, threading, time
    from kvbroker.memory.mapping import map_shared_memory
    size = 1 << 30
    name = f"kvb-memsafe-guard-{os.getpid()}"
    fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    seg = map_shared_memory(name, "bench")
    os.truncate("/dev/shm/" + name, 0)
    os.unlink("/dev/shm/" + name)
    out = {}
    def write(n):
        started = time.perf_counter()
        ctypes.memset(seg.address, 7, n)
        out.setdefault("ms", []).append((time.perf_counter() - started) * 1e3)
    for n in (4096, 4096):  # the first takes the fault; the second runs on the zero pages it left
        t = threading.Thread(target=write, args=(n,))
        t.start()
        t.join()
    out["poisoned"] = seg.poisoned
    seg.close()
    print(json.dumps(out))
""")


def guard_section() -> dict:
    result = subprocess.run([sys.executable, "-c", GUARD_CHILD], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    if result.returncode != 0:
        return {"error": f"child exited {result.returncode}: {result.stderr[-2000:]}"}
    out = json.loads(result.stdout)
    return {"mapping_bytes": 1 << 30, "first_write_ms": round(out["ms"][0], 3),
            "second_write_ms": round(out["ms"][1], 3), "poisoned": out["poisoned"],
            "timing": "one 4 KiB memset from a thread: with the fault (the guard's mmap over 1 GiB) and after"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pages", type=int, default=ENGINE.num_pages, help="pages per layer buffer (1024: 640 MiB)")
    parser.add_argument("--backends", default="nixl,mooncake")
    parser.add_argument("--sections", default="reserve,register,check,guard",
                        help="a subset; register alone also runs against brokers of an older checkout "
                             "(PYTHONPATH=<its root>), for the figures before")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    shape = dataclasses.replace(ENGINE, num_pages=args.pages)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report = {"meta": {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": sha.strip(),
                       "kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()}}
    if "reserve" in sections:
        report["reserve"] = reserve_section(shape, args.repeats)
    if "register" in sections:
        report["register"] = asyncio.run(register_section(shape, args.repeats, args.backends.split(",")))
        report["register"]["brokers_from"] = os.environ.get("PYTHONPATH") or str(ROOT)
    if "check" in sections:
        report["check"] = check_section(100_000)
    if "guard" in sections:
        report["guard"] = guard_section()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    for row in report.get("reserve", {}).get("rows", []):
        print(f"reserve  {row['segment']:9} {row['mode']:8} {row['ms']:9.3f} ms", file=sys.stderr)
    for row in report.get("register", {}).get("rows", []):
        print(f"register {row['backend']:9} {row['segment']:9} {row['register_ms']:9.3f} ms "
              f"(unregister {row['unregister_ms']:.3f})", file=sys.stderr)
    if "check" in report:
        print(f"check    {report['check']['check_segments_us']} us (fstat {report['check']['fstat_us']} us)",
              file=sys.stderr)
    if "guard" in report:
        print(f"guard    {report['guard']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
