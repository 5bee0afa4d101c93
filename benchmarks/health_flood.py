"""How fast health answers while the peer port is flooded, on the local API and on the health listener
side by side: a measurement, not a test.

    scripts/in-netns.sh .venv/bin/python benchmarks/health_flood.py [--seconds S] [--out FILE]

One real broker (`kvbroker serve`, NIXL, default settings but allow_unprotected_transports, and
health_listen on a TCP port of loopback, as the local API is here) on loopback. Its health is checked
over and over on both listeners at once, each from a process of its own, one check after the other,
for `--seconds` in each phase: on the local API (served by the asyncio loop the peer port shares) and
on the health listener (grpc's synchronous server, threads of its own: what the probes ask, deploy/,
kvbroker.ops.probe).

- `calm`: nothing else;
- `idle`: 3000 TCP connections to the peer port that never speak (over max_peer_connections, 1024);
- `busy-4`, `busy-16`: 4 or 16 connections, each sending one 9 MB OfferGrant (3 page lists of a
  million ids, in a stranger's name: refused by the per-peer page quota once one is kept) after
  the other, from a process of their own;
- `idle+busy-16`: both.

Per phase and listener (`local_api`, `health_listener`): the checks' count, median, 99th percentile
and slowest (seconds), those that failed (a check has 10 s); per phase, the peer port's health asked
on a new connection, the busy callers' answers, and the broker's CPU seconds per second. JSON on
stdout (or --out), with the machine's load average; a summary on stderr. The same run's `calm`
phase is the baseline the others are read against, and each phase's two listeners each other's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvbroker_tools.launch import start_broker  # noqa: E402

IDLE = 3000
CHECK_TIMEOUT_S = 10.0

FLOODER = """
import json, secrets, sys, threading, grpc
from kvbroker_client.v1 import common_pb2 as pb, peer_service_pb2 as ppb
address, callers = sys.argv[1], int(sys.argv[2])
data = ppb.OfferGrantRequest(
    broker_id="stranger", epoch=1, peer_address="127.0.0.1:9", engine_id="decode-x/tp0", request_id="x",
    pages=[pb.ComponentPages(component=c, page_ids=range(1 << 20)) for c in (1, 2, 4)], remaining_ms=60000,
    offer_token=secrets.token_hex(16), generation=1).SerializeToString()
options = [("grpc.max_send_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
channels = [grpc.insecure_channel(address, options=options) for _ in range(callers)]
for channel in channels:
    grpc.channel_ready_future(channel).result(timeout=60)
codes, stop, lock = {}, threading.Event(), threading.Lock()
def caller(channel):
    send = channel.unary_unary("/kvbroker.v1.PeerService/OfferGrant")
    while not stop.is_set():
        try:
            send(data, timeout=30)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        with lock:
            codes[code] = codes.get(code, 0) + 1
threads = [threading.Thread(target=caller, args=(c,), daemon=True) for c in channels]
for thread in threads:
    thread.start()
print("ready", flush=True)
sys.stdin.read()
stop.set()
for thread in threads:
    thread.join(60)
print(json.dumps(codes), flush=True)
"""

PROBER = """
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address, timeout = sys.argv[1], float(sys.argv[2])
with grpc.insecure_channel(address) as channel:
    grpc.channel_ready_future(channel).result(timeout=60)
    print("ready", flush=True)
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        started = time.monotonic()
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service="kvbroker.v1.BrokerService"), timeout=timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            status = exc.code().name
        print(status, round(time.monotonic() - started, 6), flush=True)
        time.sleep(0.02)
"""


async def child(script: str, *args: str) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, *args, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    ready = await asyncio.wait_for(process.stdout.readline(), 90)
    if ready != b"ready\n":
        raise RuntimeError(f"a child did not start: {ready!r}")
    return process


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def idle_connections(address: str, count: int):
    host, _, port = address.rpartition(":")
    held = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((host, int(port)))
            held.append(sock)
        yield
    finally:
        for sock in held:
            sock.close()


async def fresh_peer_health(address: str) -> str:
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


def summary(answers: list[tuple[str, float]]) -> dict:
    times = sorted(t for _, t in answers)
    return {"checks": len(answers), "failed": sum(s != "SERVING" for s, _ in answers),
            "median_s": statistics.median(times) if times else None,
            "p99_s": times[min(len(times) - 1, int(0.99 * len(times)))] if times else None,
            "max_s": times[-1] if times else None}


async def phase(name: str, broker, seconds: float, idle: int, callers: int) -> dict:
    listeners = {"local_api": broker.listen, "health_listener": broker.health_listen}
    probers = {key: await child(PROBER, address, str(CHECK_TIMEOUT_S)) for key, address in listeners.items()}
    answers: dict[str, list[tuple[str, float]]] = {key: [] for key in listeners}

    async def read(key: str) -> None:
        while line := await probers[key].stdout.readline():
            status, took = line.split()
            answers[key].append((status.decode(), float(took)))

    readings = [asyncio.create_task(read(key)) for key in listeners]
    flooder = await child(FLOODER, broker.peer_listen, str(callers)) if callers else None
    codes: dict = {}
    try:
        with idle_connections(broker.peer_listen, idle):
            await asyncio.sleep(1.0)  # the flood in place before the window measured
            first, cpu_before = {k: len(a) for k, a in answers.items()}, cpu_s(broker.process.pid)
            await asyncio.sleep(seconds)
            cpu = cpu_s(broker.process.pid) - cpu_before
            windows = {k: a[first[k]:] for k, a in answers.items()}
            peer = await fresh_peer_health(broker.peer_listen)
            if flooder is not None:
                flooder.stdin.close()
                codes = json.loads((await asyncio.wait_for(flooder.stdout.readline(), 120)).decode())
    finally:
        for process in (*probers.values(), flooder):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
        await asyncio.gather(*readings)
    result = {
        "phase": name, "idle_connections": idle, "busy_callers": callers, "seconds": seconds,
        **{key: summary(window) for key, window in windows.items()},
        "peer_health_new_connection": peer, "busy_answers": codes,
        "broker_cpu_per_s": round(cpu / seconds, 3),
    }
    for key in listeners:
        r = result[key]
        print(f"{name:14} {key:15} checks {r['checks']:4}  failed {r['failed']}  median {r['median_s']:.4f}s  "
              f"p99 {r['p99_s']:.3f}s  max {r['max_s']:.3f}s", file=sys.stderr)
    print(f"{name:14} peer {peer:18} cpu/s {result['broker_cpu_per_s']}  busy {codes}", file=sys.stderr)
    return result


async def main() -> tuple[str | None, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds measured in each phase")
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    broker = await start_broker("health-flood", "--backend", "nixl", "--log-level", "ERROR",
                                "--health-listen", "127.0.0.1:0",
                                env={**os.environ, "KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS": "true"})
    try:
        phases = [await phase(name, broker, args.seconds, idle, callers) for name, idle, callers in (
            ("calm", 0, 0), ("idle", IDLE, 0), ("busy-4", 0, 4), ("busy-16", 0, 16), ("idle+busy-16", IDLE, 16))]
    finally:
        await broker.stop()
    return args.out, json.dumps({"benchmark": "health_flood", "load_average": os.getloadavg(),
                                 "cpus": os.cpu_count(), "phases": phases}, indent=2)


if __name__ == "__main__":
    out, text = asyncio.run(main())
    if out:
        Path(out).write_text(text + "\n")
    else:
        print(text)
