"""Health and transfers while the peer port is flooded, on two real brokers: the choice the probes
rest on. The probes (deploy/, kvbroker.ops.probe) ask the health listener (health_listen: Check
answered from threads of its own), and without it the local API's health; both are listeners that
no peer reaches. This pins that both answer SERVING, and that a transfer between two brokers
already connected completes, while the peer port holds its connection bound full of idle
connections and busy ones send big requests without pause. That the flood is held is checked, not
assumed: a new connection to the peer port gets no answer meanwhile. How fast health answers under
such floods is measured by benchmarks/health_flood.py (README, Health and probes), not bounded here:
the local API shares the process and its event loop with the peer port, and on a saturated machine
a busy flood delays its health by seconds; the health listener waits for the GIL only.

The flood is the test's own: raw TCP connections that never speak, and a child process whose
threads send 9 MB OfferGrants on connections of their own."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import assert_bytes, close_brokers, open_broker
from tests.support.flows import MAIN, expect_pages, offer, part
from tests.support.helpers import until
from tests.support.watch import idle_connections

pytestmark = pytest.mark.integration

BOUND = 64  # the prefill broker's max_peer_connections
IDLE = 4000  # idle connections: sixty times the bound
CALLERS = 8  # busy connections, one caller each: as many reads as one peer host may hold (max_reads_per_peer)
CHECK_TIMEOUT_S = 30.0  # a health check that has no answer by then failed, however loaded the machine (on 2
# cores at load 20 a busy flood delayed some by 4-10 s: benchmarks/health_flood.py, README)

# Busy callers: each thread its own connection, sending one 9 MB OfferGrant (3 page lists of a
# million ids, in a stranger's name: one kept, the others refused by max_offer_pages_per_peer) after
# the other. "ready" once every connection is up; on
# stdin's end, the answers' codes as JSON.
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

# Health checks of one address, one after another, each with its own timeout: "<status> <seconds>" a line.
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
                                                   stdout=asyncio.subprocess.PIPE)
    ready = await asyncio.wait_for(process.stdout.readline(), 90)
    assert ready == b"ready\n", f"a child of the test did not start: {ready!r}"
    return process


async def ended(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
    await process.wait()


class Health:
    """A listener's health, asked over and over from a process of its own (the test's own loop
    must not be what is measured): each check's answer."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.answers: list[tuple[str, float]] = []
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self.process.stdout.readline():
            status, took = line.split()
            self.answers.append((status.decode(), float(took)))

    async def stop(self) -> None:
        await ended(self.process)
        await self._reading


async def fresh_peer_health(address: str) -> str:
    """The peer port's health asked on a new connection: its status, or the error's code."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


async def probe(address: str) -> tuple[int, str]:
    """The probe the manifests run (`python -m kvbroker.ops.probe`), a new connection each time: its
    exit status and output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbroker.ops.probe", "--address", address, "--service", "kvbroker.v1.BrokerService",
        "--timeout", str(CHECK_TIMEOUT_S), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 3 * CHECK_TIMEOUT_S)
    return process.returncode, out.decode().strip()


async def test_health_answers_and_a_transfer_completes_while_the_peer_port_is_flooded(engines, request_id):
    """The prefill broker's peer port (max_peer_connections 64, connections kept while the test runs)
    gets 8 busy connections sending 9 MB OfferGrants without pause and 4000 idle ones: its local
    API's health and its health listener's answer SERVING each time (to the probe itself, on a new
    connection, too), while the peer port's answers no new connection; and a request offered by the
    decode broker (connected before the flood) is written."""
    prefill = await open_broker("flood-prefill", "nixl", "--max-peer-connections", str(BOUND),
                                "--peer-handshake-timeout-s", "600", "--peer-connection-idle-s", "600",
                                "--health-listen", "127.0.0.1:0")
    decode = await open_broker("flood-decode", "nixl")
    flooder = health = listener = None
    try:
        src = await engines.make(prefill, "prefill", seed=44)
        dst = await engines.make(decode, "decode", fill="canary")
        await offer(dst, src, f"{request_id}-warm", {MAIN: [1]})  # both brokers' channels are made before the flood
        assert (await part(src, f"{request_id}-warm", {MAIN: [0]})).status.state == pb.TRANSFER_STATE_SUCCEEDED
        assert await fresh_peer_health(prefill.peer_address) == "SERVING"
        health = Health(await child(PROBER, prefill.process.listen, str(CHECK_TIMEOUT_S)))
        listener = Health(await child(PROBER, prefill.process.health_listen, str(CHECK_TIMEOUT_S)))
        flooder = await child(FLOODER, prefill.peer_address, str(CALLERS))
        with idle_connections(prefill.peer_address, IDLE):
            # held: the bound is full, so a new connection is closed as it is accepted (or never is)
            assert await fresh_peer_health(prefill.peer_address) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
            assert await probe(prefill.process.listen) == (0, "SERVING")  # the probe's own new connection
            assert await probe(prefill.process.health_listen) == (0, "SERVING")
            before = dst.segment.array.copy()
            await offer(dst, src, request_id, {MAIN: [5, 6]}, timeout=60)
            done = await part(src, request_id, {MAIN: [2, 3]}, timeout=60)
            assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED, done.status
            assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [2, 3], [5, 6])]))
            checked, listened = len(health.answers), len(listener.answers)
            assert await until(lambda: len(health.answers) >= checked + 20 and len(listener.answers) >= listened + 20,
                               timeout=30 * CHECK_TIMEOUT_S)
            assert await fresh_peer_health(prefill.peer_address) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
            flooder.stdin.close()
            codes = json.loads((await asyncio.wait_for(flooder.stdout.readline(), 120)).decode())
        await health.stop()
        await listener.stop()
        for name, checks in (("local API", health.answers), ("health listener", listener.answers)):
            failed = [answer for answer in checks if answer[0] != "SERVING"]
            assert not failed, f"{name}: {len(failed)} of {len(checks)} health checks failed: {failed[:5]}"
        assert sum(codes.values()) >= CALLERS, codes  # the busy callers were answered: they were busy
        print(f"flooded peer port: {len(health.answers)} local API health checks, slowest "
              f"{max(t for _, t in health.answers):.3f}s; {len(listener.answers)} on the health listener, slowest "
              f"{max(t for _, t in listener.answers):.3f}s; busy callers' answers {codes}")
    finally:
        for process in (flooder, health and health.process, listener and listener.process):
            if process is not None:
                await ended(process)
        assert await close_brokers(prefill, decode) == [0, 0]
