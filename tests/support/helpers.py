"""Helpers the test modules share (one copy each), none of which needs a broker of the suite's own:

- refusals: `refusal` (the domain's BrokerError of a sync call), `rpc_refusal` (a gRPC call's AioRpcError);
- `peer_service`: a PeerService of the test's own, served on loopback;
- a process seen from outside: `listeners` (its listening ports), `scrape` (a broker's /metrics
  summed per name), `kvbroker` (the CLI run in a child process), `json_of_child` (a child's last
  line of JSON, bounded, its exit code told);
- waits for states no event announces, bounded: `until` polls a plain condition (10 s unless told),
  `until_awaited` an async one, a call each time (60 s unless told; what a broker or server holds);
- `descriptor_rows`: descriptor rows (address, length, device) for a Backend's write, without the planner.

Test modules import from here and the other modules of tests/support, never from each other or
from a conftest: tests/test_layers.py pins it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbroker.core.errors import BrokerError
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from kvbroker_tools.launch import exit_report
from kvbroker_tools.serving import stack


def refusal(fn, *args, **kwargs) -> BrokerError:
    """The BrokerError `fn(*args, **kwargs)` raises; fails the test if it raises none."""
    with pytest.raises(BrokerError) as info:
        fn(*args, **kwargs)
    return info.value


async def rpc_refusal(call) -> grpc.aio.AioRpcError:
    """The status a gRPC call ends with; fails the test if it succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@contextlib.asynccontextmanager
async def peer_service(servicer: ppb_grpc.PeerServiceServicer) -> AsyncIterator[str]:
    """`servicer` served on a loopback port of its own, for as long as the block runs: its address."""
    # past gRPC's 4 MiB default: a lying peer's handshake answer may be past the broker's bound
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    ppb_grpc.add_PeerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def listeners(pid: int, tables: tuple[str, ...]) -> set[int]:
    """Local ports of the sockets of process `pid` in these /proc/net tables: TCP ones in LISTEN
    (state 0A), or every socket of a UDP table."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in tables:
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and (table.startswith("udp") or fields[3] == "0A"):
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


async def scrape(address: str) -> dict[str, float]:
    """A broker's /metrics at `address`, each metric's samples summed over their labels."""
    def get() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            return reply.read().decode()

    totals: dict[str, float] = {}
    for line in (await asyncio.to_thread(get)).splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def kvbroker(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python -m kvbroker ARGS` to its end (bounded): exit status, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvbroker", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


def descriptor_rows(base: int, offsets, length: int) -> np.ndarray:
    """Descriptor rows of `length` bytes at `base` + each of `offsets` (bytes), on device 0."""
    out = np.zeros((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = base + np.asarray(offsets, dtype=np.uint64)
    out[:, 1] = length
    return out


async def until(condition, timeout: float = 10.0) -> bool:
    """Poll a plain `condition` (a callable returning a truth value) every 10 ms until it holds or
    `timeout` passes; its last value. For states no event announces (a process's memory, an engine's
    peers, a sweeper's work)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if (held := condition()) or loop.time() > deadline:
            return held
        await asyncio.sleep(0.01)


async def until_awaited(condition, timeout: float = 60.0, interval: float = 0.1):
    """Poll an async `condition` (a coroutine function, awaited each time) until it is truthy or
    `timeout` passes; its last value. For states no event announces that take a call to read (what
    a broker holds, a server's queue)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        held = await condition()
        if held or loop.time() > deadline:
            return held
        await asyncio.sleep(interval)


async def serving(brokers, backend: str, engines: int = 1, timeout: float = 120.0) -> dict[str, tuple[str, int]]:
    """Wait until every broker of `brokers` (kvbroker_tools.launch.BrokerProcess) runs the transfer
    engine `backend` and holds `engines` registered engines (a server's client registers again by
    itself once its broker is back); what each held last, by broker id: (backend, engines)."""
    async def held() -> dict[str, tuple[str, int]]:
        infos = {broker.broker_id: await stack.broker_info(broker) for broker in brokers}
        return {name: (info.backend, len(info.engines)) for name, info in infos.items()}

    async def ready():
        now = await held()
        return now if all(got == (backend, engines) for got in now.values()) else None

    return await until_awaited(ready, timeout=timeout) or await held()


async def json_of_child(what: str, *argv: str, timeout: float, env: dict[str, str] | None = None,
                        cwd: Path | None = None) -> dict:
    """Run `argv` as a child process; the JSON of its last line of stdout. A child past `timeout` is
    killed with the case; one that fails says `what` it was, its exit code and its stderr's tail."""
    child = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(child.communicate(), timeout)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode == 0, exit_report(what, child.returncode, err.decode(errors="replace").splitlines())
    return json.loads(out.decode().strip().splitlines()[-1])
