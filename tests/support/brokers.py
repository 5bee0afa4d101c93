"""Real brokers in subprocesses on loopback and engines on them, for the tests that talk to a broker
through its gRPC stubs (tests/integration, tests/unit, tests/deploy): tests/conftest.py's `brokers`
(one pair per backend) and `engines` fixtures are made of these.

- `open_broker`, `close_broker`, `close_brokers`: a broker of a test's own (`Broker`; `BrokerPair`);
- `Engines`: engines (`Engine`) registered over shared-memory pools, released after the test;
- `expected_after`, `assert_bytes`: every byte of a destination pool after a transfer;
- `run_engines_in_child`: engines created by a test itself, in a child process (NIXL's exit).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from kvbroker_tools.launch import BrokerProcess, start_broker, stop_all
from tests.support import REPO_ROOT
from tests.support.helpers import json_of_child

BACKENDS = ["nixl", "mooncake"]

SMALL = shapes.SMALL  # 3 dense + 4 sparse layers, 64 pages per buffer
ALL = [pb.COMPONENT_MAIN_KV, pb.COMPONENT_MINIMAX_INDEX_K]


@dataclass
class Broker:
    process: BrokerProcess
    channel: grpc.aio.Channel
    stub: bpb_grpc.BrokerServiceStub

    @property
    def peer_address(self) -> str:
        return self.process.peer_listen


@dataclass
class BrokerPair:
    backend: str
    prefill: Broker
    decode: Broker


async def open_broker(name: str, backend: str, *args: str, **options) -> Broker:
    """A broker on loopback; `options` go to start_broker (env, prefix, ...)."""
    process = await start_broker(name, "--backend", backend, "--log-level", "WARNING", *args, **options)
    channel = grpc.aio.insecure_channel(process.listen)
    return Broker(process, channel, bpb_grpc.BrokerServiceStub(channel))


async def close_broker(broker: Broker) -> int:
    """Its exit code; ChildDied (with how it ended and its stderr tail) if it died unasked."""
    await broker.channel.close()
    return await broker.process.stop()


async def close_brokers(*brokers: Broker) -> list[int]:
    """Close every one, then raise for those that died: one broker's death never leaks the others."""
    for broker in brokers:
        await broker.channel.close()
    await stop_all(b.process for b in brokers)
    return [b.process.process.returncode for b in brokers]


@dataclass
class Engine:
    """An engine registered on a broker, over its own shared-memory pool."""

    broker: Broker
    engine_id: str
    shape: shapes.ModelShape
    segment: SharedSegment
    placements: list[shapes.BufferPlacement]
    components: list[int] = field(default_factory=list)

    @property
    def stub(self) -> bpb_grpc.BrokerServiceStub:
        return self.broker.stub


_engine_numbers = iter(range(1, 1 << 30))


class Engines:
    """Registers engines for one test and releases them (and their segments) after it."""

    def __init__(self) -> None:
        self._made: list[Engine] = []

    async def make(self, broker: Broker, role: str, shape: shapes.ModelShape = SMALL,
                   components=("MAIN_KV", "MINIMAX_INDEX_K"), main_layout: str = "KV_SPLIT",
                   fill: str = "random", seed: int = 0, session_id: str = "", **topology) -> Engine:
        number = next(_engine_numbers)
        placements = shapes.place_buffers(shape, components, main_layout)
        segment = SharedSegment.create(shapes.pool_size(shape, placements), f"kvbt-{role}")
        if fill == "random":
            shapes.fill_random(segment.array, np.random.default_rng(seed + number))
        else:
            segment.array[:] = shapes.CANARY
        engine_id = f"{role}-{os.getpid()}-{number}/tp0"
        request = shapes.register_request(engine_id, shape, segment, placements, main_layout,
                                        shapes.topology(shape, **topology))
        request.session_id = session_id
        engine = Engine(broker, engine_id, shape, segment, placements,
                        [c.component for c in request.components])
        self._made.append(engine)
        await broker.stub.RegisterEngine(request, timeout=30)
        return engine

    async def close(self) -> None:
        for engine in self._made:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):  # its broker may be gone
                await engine.stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=engine.engine_id),
                                                   timeout=30)
            engine.segment.close()
            engine.segment.unlink()


def expected_after(src: Engine, dst: Engine, before: np.ndarray, components, src_ids, dst_ids) -> np.ndarray:
    return shapes.expected_destination(src.segment.array, before, dst.shape, dst.placements, set(components),
                                     np.asarray(src_ids), np.asarray(dst_ids))


def assert_bytes(dst: Engine, expected: np.ndarray) -> None:
    """Every byte of the destination pool: moved pages equal the source, all else still canary."""
    diff = np.flatnonzero(dst.segment.array != expected)
    assert diff.size == 0, f"{diff.size} bytes differ, first at offset {diff[0] if diff.size else None}"


async def run_engines_in_child(module: str, function: str, backend: str, timeout: float) -> dict:
    """`await module.function(backend)` in a child process, and the dict it returned.

    NIXL's UCX teardown crashes at interpreter exit, so engines created directly by a test live in a
    child that leaves with os._exit, as `kvbroker serve` does, and reports what it saw as one JSON line.
    """
    import sys

    code = (f"import asyncio, json, os, sys; from {module} import {function}; "
            f"print(json.dumps(asyncio.run({function}(sys.argv[1]))), flush=True); os._exit(0)")
    return await json_of_child(f"{module}.{function}({backend!r}) in a child", sys.executable, "-X", "faulthandler",
                               "-c", code, backend, timeout=timeout, cwd=REPO_ROOT)
