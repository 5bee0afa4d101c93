"""Watching a broker under a flood (test_bounds.py, test_lying_peer.py): `Watch` samples its peak
VmRSS and times its health checks from a prober process of its own while the flood runs; `prompt_bound`
turns a baseline measured in the same run into the bound a call may take under the flood;
`rss_mib` and `cpu_s` read one process from /proc. Not a test module: test modules import from
here, never from each other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import sys

from tests.support.helpers import until

HEALTH_PROMPT_S = 2.0  # the least "answers promptly" allows, however fast its baseline (health was 5.9 s
# under the flood when the work came before the refusal)
HEALTH_TIMEOUT_S = 10.0  # a health check under a flood that has no answer by then failed, however loaded the
# machine (its speed: benchmarks/health_flood.py)
SLOWDOWN = 3  # how much slower than its baseline, measured in the same run, a call may be under a flood


def prompt_bound(baseline: list[float], floor: float = HEALTH_PROMPT_S) -> float:
    """How long a call may take under a flood: SLOWDOWN times the slowest of the same calls measured
    just before on the same broker, in the same run (a loaded machine slows both alike), never less
    than `floor`. No absolute bound: on 2 cores shared with other jobs a fixed one fails for load alone."""
    assert baseline, "no baseline was measured"
    return max(floor, SLOWDOWN * max(baseline))


def cpu_s(pid: int) -> float:
    """CPU seconds the process has used, all its threads, user and system: what its work costs,
    whatever else the machine runs."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


# The health prober, a process of its own: timed in the test's own process, a health check also
# waits for the flood the test is sending (16 channels pushing 55 MiB each), which made a first check
# look 4.9 s slow while the broker answered the next ones in milliseconds. Its channels are connected
# before the flood, so what it times is the broker's answer.
PROBER = """
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
timeout, addresses = float(sys.argv[1]), sys.argv[2:]
channels = [grpc.insecure_channel(a) for a in addresses]
for channel in channels:
    grpc.channel_ready_future(channel).result(timeout=60)
print("ready", flush=True)
while True:
    for channel in channels:
        started = time.monotonic()
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            status = exc.code().name
        print(status, time.monotonic() - started, flush=True)
    time.sleep(0.02)
"""


class Watch:
    """While a flood runs: the broker's peak VmRSS, and what its health checks answer and how long they
    take (asked by PROBER, in a process of its own, each with HEALTH_TIMEOUT_S)."""

    def __init__(self, pid: int, addresses: list[str]) -> None:
        self.pid = pid
        self.addresses = addresses
        self.peak = rss_mib(pid)
        self.health_s: list[float] = []
        self.health: list[str] = []  # each check's answer: SERVING, or its error's code
        self.cpu_s = 0.0  # the broker's CPU seconds while it ran
        self._stop = asyncio.Event()

    async def _sample_rss(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(FileNotFoundError, AssertionError):
                self.peak = max(self.peak, rss_mib(self.pid))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.02)

    async def _read(self, prober: asyncio.subprocess.Process) -> None:
        while line := await prober.stdout.readline():
            status, took = line.split()
            self.health.append(status.decode())
            self.health_s.append(float(took))

    def assert_serving(self) -> None:
        """Every health check answered SERVING, within HEALTH_TIMEOUT_S, and there were some."""
        assert len(self.health) >= 2 * len(self.addresses), f"only {len(self.health)} health checks"
        failed = [(s, round(t, 2)) for s, t in zip(self.health, self.health_s) if s != "SERVING"]
        assert not failed, f"{len(failed)} of {len(self.health)} health checks failed: {failed[:5]}"

    @contextlib.asynccontextmanager
    async def during(self):
        prober = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PROBER, str(HEALTH_TIMEOUT_S), *self.addresses,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        try:
            ready = await asyncio.wait_for(prober.stdout.readline(), 90)
            assert ready == b"ready\n", f"the health prober did not start: {ready!r}"
            sampling = asyncio.create_task(self._sample_rss())
            reading = asyncio.create_task(self._read(prober))
            cpu_before = cpu_s(self.pid)
            try:
                yield self
                self.cpu_s = cpu_s(self.pid) - cpu_before
                # one more round of checks after the flood's last call: each check that was running ends
                wanted = len(self.health_s) + 2 * len(self.addresses)
                await until(lambda: len(self.health_s) >= wanted, timeout=3 * len(self.addresses) * HEALTH_TIMEOUT_S)
            finally:
                self._stop.set()
                await sampling
                if prober.returncode is None:
                    prober.kill()
                await prober.wait()
                await reading
        finally:
            if prober.returncode is None:
                prober.kill()
                await prober.wait()


@contextlib.contextmanager
def idle_connections(address: str, count: int):
    """`count` TCP connections to `address` that never say a word."""
    host, _, port = address.rpartition(":")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 1024)), hard))
    held = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((host, int(port)))
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
