"""The local API's Unix socket has its final mode from the moment anyone can reach it, even under umask 0,
and the directories the broker creates for it are 0750. Observed at bind time: a broker started in a
child whose umask is 0, with grpc's add_insecure_port wrapped to look at the socket as soon as it is bound."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from tests.support.brokers import REPO_ROOT

pytestmark = pytest.mark.integration

CHILD = r"""
import asyncio, json, os, stat, sys
os.umask(0)
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvbroker.config import Settings
from kvbroker.server import BrokerServer

root, backend = sys.argv[1], sys.argv[2]
final = os.path.join(root, "run", "kvbroker", "kvbroker.sock")
seen = []
bind = grpc.aio._server.Server.add_insecure_port

def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else None

def observed(self, address):
    port = bind(self, address)
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        seen.append({"bound": path, "mode": mode(path), "directory": mode(os.path.dirname(path)),
                     "final": mode(final)})
    return port

grpc.aio._server.Server.add_insecure_port = observed

async def main():
    server = BrokerServer(Settings(backend=backend, broker_id="socket-mode", listen=f"unix:{final}",
                                   peer_listen="127.0.0.1:0"))
    await server.startup()
    async with grpc.aio.insecure_channel(f"unix:{final}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    report = {"seen": seen, "socket": mode(final), "run": mode(os.path.join(root, "run")),
              "kvbroker": mode(os.path.dirname(final)), "serving": reply.status == 1,
              "left": sorted(os.listdir(os.path.dirname(final)))}
    await server.shutdown(0)
    report["after"] = sorted(os.listdir(os.path.dirname(final)))
    print(json.dumps(report), flush=True)
    os._exit(0)  # NIXL's teardown at interpreter exit is not ours to test

asyncio.run(main())
"""


async def test_the_local_socket_is_never_reachable_with_more_than_its_final_mode(tmp_path):
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, str(tmp_path), "nixl", cwd=REPO_ROOT,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0, err.decode(errors="replace")[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    (bound,) = report["seen"]
    private = bound["directory"] & 0o077 == 0  # nobody but the broker's user reaches into it
    assert bound["mode"] == 0o660 or private, f"socket {oct(bound['mode'])} in a {oct(bound['directory'])} directory"
    assert bound["final"] is None, "the socket's path existed before it had its mode"
    assert report["socket"] == 0o660 and report["serving"]
    assert report["run"] == report["kvbroker"] == 0o750, report
    assert report["left"] == ["kvbroker.sock"] and report["after"] == [], report
