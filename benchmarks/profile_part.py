"""Where one request's broker CPU goes at concurrency 1 (issue 22): `py-spy record` on both brokers
while one client runs the bench's offered flow on the Exchange stream, one request after another
(decode's ExpectTransfer naming the sender, then prefill's one last part of one page: the bench's
control-plane request). JSON on stdout (or --out): requests, the part's p50, each broker's CPU per
request from /proc (a second window without py-spy, so the sampler's own cost is not in it), and
per broker the sampled milliseconds per request of each thread and of each function (inclusive),
largest first.

    scripts/in-netns.sh .venv/bin/python benchmarks/profile_part.py --backend nixl --out prof.json

Needs py-spy (`pip install -e '.[bench]'`). Sampled time counts a thread while it runs or waits
for a core (py-spy leaves out threads idle in a syscall), so on a loaded machine it is above the
CPU figure; read the shares, not the sum. Time inside gRPC's and uvloop's C code shows as the self
time of the frame that entered it (`Runner.run` for the event loop's own work).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvbroker_client.client import BrokerClient
from kvbroker_client.shm import SharedSegment
from kvbroker_tools import shapes
from kvbroker_tools.bench_children import _offered
from kvbroker_tools.bench_setup import open_side
from kvbroker_tools.shapes import BENCH_CONTROL

RATE_HZ = 1000
FRAME = re.compile(r"(?P<name>.*) \((?P<file>.*?):\d+\)$")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 10 ms


def spy_command(pid: int, seconds: float, out: Path) -> list[str]:
    """py-spy sampling `pid` without stopping it (--nonblocking: the broker's timing stays its own)."""
    return ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(RATE_HZ), "-f", "raw",
            "--nonblocking", "-o", str(out)]


def frame_key(frame: str) -> str:
    match = FRAME.match(frame)
    if not match:
        return frame
    where = match["file"].split("site-packages/")[-1]
    where = where[where.find("kvbroker/"):] if "kvbroker/" in where else where
    return f"{match['name']} ({where})"


def per_request(raw: Path, requests: int, top: int) -> dict:
    """py-spy's raw output (`frame;frame;... count`) as sampled ms per request: by thread (the
    stack's root) and by function, counted once per stack (inclusive)."""
    threads, functions, samples = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [frame_key(f) for f in stack.split(";")]
        samples += int(count)
        threads[frames[0]] += int(count)
        for key in set(frames):
            functions[key] += int(count)
        functions[f"(self) {frames[-1]}"] += int(count)
    ms = 1e3 / RATE_HZ / requests
    return {"sampled_ms_per_request": round(samples * ms, 3),
            "threads": {k: round(c * ms, 3) for k, c in threads.most_common(4)},
            "functions": {k: round(c * ms, 3) for k, c in functions.most_common(top)}}


async def requests_for(seconds: float, config: dict, prefill, decode, pids: dict[str, int]) -> dict:
    """One request after another for `seconds`: how many, the part's p50, each broker's CPU per request."""
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    parts, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        _, part_s = await _offered(config, prefill, decode, f"prof-{len(parts)}-{time.monotonic_ns()}",
                                   len(parts) % 4)
        parts.append(part_s)
    return {"requests": len(parts), "part_p50_ms": round(statistics.median(parts) * 1e3, 3),
            "cpu_ms_per_request": {name: round((cpu_s(pid) - before[name]) * 1e3 / len(parts), 3)
                                   for name, pid in pids.items()}}


async def profile(backend: str, seconds: float, top: int, sample: bool = True) -> dict:
    side = await open_side(backend, False, 60.0)
    placements = shapes.place_buffers(BENCH_CONTROL)
    size = shapes.pool_size(BENCH_CONTROL, placements)
    engines = ("prof-src", "prof-dst")
    try:
        with SharedSegment.create(size, "kvb-prof-src") as src, SharedSegment.create(size, "kvb-prof-dst") as dst:
            for client, engine_id, segment in ((side.p_client, engines[0], src), (side.d_client, engines[1], dst)):
                request = shapes.register_request(engine_id, BENCH_CONTROL, segment, placements)
                await client.register_engine(engine_id, request.topology, list(request.components), timeout=60)
            config = {"prefill_peer": side.prefill.peer_listen, "prefill_engine": engines[0],
                      "decode_engine": engines[1]}
            pids = {"prefill_broker": side.prefill.pid, "decode_broker": side.decode.pid}
            prefill = await BrokerClient.connect(side.prefill.listen)  # on the Exchange stream
            decode = await BrokerClient.connect(side.decode.listen)
            try:
                await requests_for(2.0, config, prefill, decode, pids)  # warm: streams, handshake, caches
                plain = await requests_for(seconds, config, prefill, decode, pids)
                if not sample:
                    return {"backend": backend, "seconds": seconds, "without_py_spy": plain}
                with tempfile.TemporaryDirectory() as out:
                    spies = {name: await asyncio.create_subprocess_exec(
                        *spy_command(pid, seconds, Path(out) / f"{name}.txt"), stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL) for name, pid in pids.items()}
                    sampled = await requests_for(seconds, config, prefill, decode, pids)
                    for name, spy in spies.items():
                        if await asyncio.wait_for(spy.wait(), seconds + 60):
                            raise RuntimeError(f"py-spy on {name} exited {spy.returncode}")
                    profiles = {name: per_request(Path(out) / f"{name}.txt", sampled["requests"], top)
                                for name in pids}
            finally:
                await prefill.close()
                await decode.close()
                for client, engine_id in ((side.p_client, engines[0]), (side.d_client, engines[1])):
                    await client.unregister_engine(engine_id, timeout=60)
    finally:
        await side.close()
    return {"backend": backend, "seconds": seconds, "without_py_spy": plain, "with_py_spy": sampled,
            "profiles": profiles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="nixl", choices=("nixl", "mooncake"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=80, help="functions kept per broker")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cpu-only", action="store_true",
                        help="only the window without py-spy: requests, part p50, CPU per request")
    args = parser.parse_args()
    if shutil.which("py-spy") is None and not args.cpu_only:
        sys.exit("profile_part.py: py-spy is not on PATH (pip install -e '.[bench]')")
    report = asyncio.run(profile(args.backend, args.seconds, args.top, sample=not args.cpu_only))
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
