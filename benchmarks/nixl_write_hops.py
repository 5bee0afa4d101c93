"""What a one-page part costs the NIXL backend (kvbroker/backends/nixl.py): the figures behind
POST_SPIN_S and the one-hop write. JSON on stdout (or --out), a summary on stderr.

    scripts/in-netns.sh .venv/bin/python benchmarks/nixl_write_hops.py --out benchmarks/out/hops.json
    scripts/in-netns.sh env UCX_TLS=tcp .venv/bin/python benchmarks/nixl_write_hops.py

The part is the bench's control-plane page: three descriptors of 4, 4 and 2 KiB, written by a
NixlBackend on uvloop (as brokers run) into a receiving NixlBackend in another process.
- settle: on the NIXL thread, transfer() and then check_xfer_state in a loop until the state
  leaves PROC: how long transfer() takes, how long after it the part ends, the share that ended
  at transfer() already and the share that ended within each spin bound.
- write: Backend.write of the same part, one after another: its latency and the sending process's
  CPU per write (all its threads). Run it on two commits to compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np
import uvloop

from kvbroker.backends import create_backend
from kvbroker.config import Settings
from kvbroker.core.model import Descriptors, Region

RECEIVER = """
import asyncio, json, numpy as np
from kvbroker.backends import create_backend
from kvbroker.config import Settings
from kvbroker.core.model import Region
async def main():
    backend = create_backend(Settings(backend="nixl", peer_listen="127.0.0.1:0"), "hops-receiver")
    await backend.start()
    dst = np.zeros(1 << 20, dtype=np.uint8)
    await backend.register([Region(dst.ctypes.data, dst.nbytes, 0, gpu=False)])
    print(json.dumps([(await backend.metadata()).hex(), dst.ctypes.data]), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""
SPIN_BOUNDS_US = (50, 100, 150, 200, 300, 500, 1000)
GIVE_UP_S = 0.05  # a settle sample that is still PROC by then is counted as ended after every bound


def part_rows(base: int) -> np.ndarray:
    return np.array([[base, 4096, 0], [base + 65536, 4096, 0], [base + 131072, 2048, 0]], dtype=np.uint64)


def percentiles(values) -> dict:
    return {p: round(float(np.percentile(values, p)), 1) for p in (10, 50, 90, 99)}


async def measure(writes: int, samples: int) -> dict:
    receiver = await asyncio.create_subprocess_exec(sys.executable, "-c", RECEIVER, stdout=asyncio.subprocess.PIPE)
    try:
        metadata, address = json.loads(await asyncio.wait_for(receiver.stdout.readline(), 60))
        sender = create_backend(Settings(backend="nixl", peer_listen="127.0.0.1:0"), "hops-sender")
        await sender.start()
        src = np.ones(1 << 20, dtype=np.uint8)
        await sender.register([Region(src.ctypes.data, src.nbytes, 0, gpu=False)])
        peer = await sender.connect(bytes.fromhex(metadata))
        part = Descriptors(part_rows(src.ctypes.data), part_rows(address))
        agent = sender._agent

        def settle() -> tuple[float, float, bool]:
            local, remote = agent.get_xfer_descs(part.src, "DRAM"), agent.get_xfer_descs(part.dst, "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, peer)
            start = time.perf_counter()
            state = agent.transfer(handle)
            posted = time.perf_counter()
            at_once = state != "PROC"
            while state == "PROC" and time.perf_counter() - posted < GIVE_UP_S:
                state = agent.check_xfer_state(handle)
            ended = time.perf_counter()
            agent.release_xfer_handle(handle)
            return (posted - start) * 1e6, (ended - posted) * 1e6, at_once

        for _ in range(100):
            await sender.write(peer, part, timeout=30)
        settled = []
        for _ in range(samples):
            settled.append(await sender._call(settle))
            await asyncio.sleep(0.001)  # the receiver's side settles as between parts
        latencies = []
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(writes):
            start = time.perf_counter()
            await sender.write(peer, part, timeout=30)
            latencies.append((time.perf_counter() - start) * 1e6)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        after = np.array([s[1] for s in settled])
        return {
            "ucx_tls": os.environ.get("UCX_TLS", "UCX's choice"),
            "settle": {"samples": samples, "transfer_call_us": percentiles([s[0] for s in settled]),
                       "after_transfer_us": percentiles(after),
                       "ended_at_transfer": round(float(np.mean([s[2] for s in settled])), 3),
                       "ended_within_us": {b: round(float(np.mean(after <= b)), 3) for b in SPIN_BOUNDS_US}},
            "write": {"writes": writes, "latency_us": percentiles(latencies),
                      "sender_cpu_us_per_write": round(cpu / writes * 1e6, 1),
                      "wall_us_per_write": round(wall / writes * 1e6, 1)},
            "load": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        receiver.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=3000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = uvloop.run(measure(args.writes, args.samples))
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    print(f"{report['ucx_tls']}: write p50 {report['write']['latency_us'][50]} us, "
          f"{report['write']['sender_cpu_us_per_write']} us CPU; ended at transfer() "
          f"{report['settle']['ended_at_transfer']:.0%}, within 200 us {report['settle']['ended_within_us'][200]:.0%}",
          file=sys.stderr, flush=True)
    os._exit(0)  # NIXL's UCX teardown crashes at interpreter exit


if __name__ == "__main__":
    main()
