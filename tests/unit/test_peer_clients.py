"""PeerClients against scripted peers (in-process gRPC servers on loopback) and a backend that counts:
handshake answers are ordered by when they were sent, never by comparing epochs, and an address left
unused for idle_s is forgotten while one in use is not."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest_asyncio

from kvbroker.backends.base import Backend
from kvbroker.core.model import (
    BufferLayout,
    BufferRole,
    Component,
    ComponentLayout,
    EngineLayout,
    KvDtype,
    Layout,
    Topology,
)
from kvbroker.edge import convert
from kvbroker.ops.metrics import Metrics
from kvbroker.peers.clients import PeerClients
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from tests.support.helpers import peer_service, until

TIMEOUT = 5.0
IDLE_S = 0.5


def layout(engine_id: str) -> EngineLayout:
    topology = Topology(1, 0, 1, 0, 1, 0, 0, 4, 0, 1, KvDtype.BFLOAT16)
    buffers = (BufferLayout(0, BufferRole.FLAT, 1 << 20, 64 * 16, 64),)
    return EngineLayout(engine_id, topology,
                        {Component.MAIN_KV: ComponentLayout(Component.MAIN_KV, Layout.FLAT, 16, buffers)})


class ScriptedPeer(ppb_grpc.PeerServiceServicer):
    """A peer broker whose epoch the test sets; a held engine's handshake is answered, with the epoch of
    the moment it arrived, only when the test releases it (the old process answering late)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.epoch = 1
        self.held: dict[str, asyncio.Event] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.handshakes = 0

    async def Handshake(self, request: ppb.HandshakeRequest, context) -> ppb.HandshakeResponse:
        epoch = self.epoch
        self.handshakes += 1
        self.arrived.setdefault(request.engine_id, asyncio.Event()).set()
        if (gate := self.held.pop(request.engine_id, None)) is not None:
            await gate.wait()
        return ppb.HandshakeResponse(broker_id="decode", epoch=epoch, generation=1, backend="counting",
                                     backend_metadata=f"{self.name}@{epoch}".encode(),
                                     engine=convert.engine_layout_out(layout(request.engine_id)))


class CountingBackend(Backend):
    """Connects and disconnects counted per peer handle (the metadata); `busy` handles are being written to."""

    name = "counting"

    def __init__(self) -> None:
        self.connects: Counter[str] = Counter()
        self.disconnects: Counter[str] = Counter()
        self.busy: set[str] = set()

    async def start(self) -> None: ...
    async def register(self, regions: Sequence) -> object: ...
    async def deregister(self, handle: object) -> None: ...
    async def metadata(self) -> bytes: return b""
    def is_own(self, metadata: bytes) -> bool: return metadata == b"own"
    async def write(self, peer, descriptors, timeout: float) -> None: ...
    async def close(self) -> None: ...

    async def connect(self, metadata: bytes, regions=()) -> object:
        self.connects[metadata.decode()] += 1
        return metadata.decode()

    async def disconnect(self, peer: object) -> None:
        self.disconnects[peer] += 1

    def writing(self, peer: object) -> bool:
        return peer in self.busy


@pytest_asyncio.fixture
async def peers() -> AsyncIterator[list[tuple[ScriptedPeer, str]]]:
    """Three scripted peer brokers, each at its own address."""
    async with contextlib.AsyncExitStack() as stack:
        made = [ScriptedPeer(f"p{n}") for n in range(3)]
        yield [(peer, await stack.enter_async_context(peer_service(peer))) for peer in made]


class Sender(PeerClients):
    """PeerClients as a broker builds them, with the backend and metrics they were given at hand."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.backend, self.metrics = CountingBackend(), Metrics()
        super().__init__("prefill", 7, self.backend, idle_s=idle_s, metrics=self.metrics)


@pytest_asyncio.fixture
async def clients() -> AsyncIterator[Sender]:
    made = Sender()
    yield made
    await made.close()


async def session(clients: PeerClients, address: str, engine_id: str, refresh: bool = False):
    return await clients.session(address, engine_id, refresh=refresh, timeout=TIMEOUT)


def sweepers() -> int:
    return sum(task.get_name() == "peer idle sweeper" and not task.done() for task in asyncio.all_tasks())


# -- epochs ---------------------------------------------------------------------------------------

async def test_an_answer_sent_before_a_peer_restart_does_not_undo_the_restart(peers, clients):
    peer, address = peers[0]
    peer.epoch = 900
    await session(clients, address, "decode/c")
    gate = peer.held["decode/a"] = asyncio.Event()
    peer.arrived["decode/a"] = asyncio.Event()
    late = asyncio.create_task(session(clients, address, "decode/a"))
    await asyncio.wait_for(peer.arrived["decode/a"].wait(), TIMEOUT)  # sent to, and taken by, the old process

    peer.epoch = 100  # the peer restarted; its new epoch is the smaller number
    b = await session(clients, address, "decode/b")
    gate.set()
    a = await asyncio.wait_for(late, TIMEOUT)

    assert (b.epoch, a.epoch) == (100, 100), "the late answer of the old process was taken as the peer's"
    assert await session(clients, address, "decode/b") is b, "the new epoch's handshake was dropped"
    assert clients.records[address].epoch == 100
    assert await until(lambda: clients.backend.disconnects == Counter({"p0@900": 2}))
    assert clients.backend.connects == Counter({"p0@900": 2, "p0@100": 2})
    assert clients.metrics.registry.get_sample_value("kvbroker_peer_epoch_changes_total") == 1


async def test_a_later_answer_with_a_smaller_epoch_is_a_restart(peers, clients):
    """Epochs are compared for equality only: a restarted peer may well have the smaller one."""
    peer, address = peers[0]
    peer.epoch = 900
    old = await session(clients, address, "decode/a")
    peer.epoch = 100
    new = await session(clients, address, "decode/a", refresh=True)
    assert (old.epoch, new.epoch, clients.records[address].epoch) == (900, 100, 100)
    assert await until(lambda: clients.backend.disconnects == Counter({"p0@900": 1}))


# -- idle addresses -------------------------------------------------------------------------------

async def test_an_address_unused_for_idle_s_is_forgotten(peers, clients):
    peer, address = peers[0]
    await session(clients, address, "decode/a")
    await session(clients, address, "decode/b")
    assert address in clients.records

    assert await until(lambda: address not in clients.records)
    assert await until(lambda: clients.backend.disconnects == Counter({"p0@1": 2}))
    await session(clients, address, "decode/a")  # usable again: a fresh handshake
    assert (peer.handshakes, clients.records[address].handshakes) == (3, 1)
    assert await until(lambda: address not in clients.records), "the sweeper did not start again"


async def test_an_address_in_use_is_not_forgotten(peers, clients):
    (_, unused), (_, used) = peers[:2]
    await session(clients, unused, "decode/a")
    await session(clients, used, "decode/a")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while unused in clients.records:
        assert loop.time() < deadline, "the unused address was never forgotten"
        await session(clients, used, "decode/a")  # a handshake served from the cache is a use too
        await asyncio.sleep(IDLE_S / 10)
    deadline = loop.time() + 3 * IDLE_S
    while loop.time() < deadline:
        await session(clients, used, "decode/a")
        await asyncio.sleep(IDLE_S / 10)
    assert used in clients.records and clients.records[used].handshakes == 1
    assert clients.backend.disconnects == Counter({"p0@1": 1})  # the unused one's only


async def test_an_address_is_not_forgotten_while_a_write_through_it_runs(peers, clients):
    (_, writing), (_, idle) = peers[:2]
    handle = (await session(clients, writing, "decode/a")).peer_handle
    clients.backend.busy.add(handle)
    await session(clients, idle, "decode/a")  # used after the other: due later

    assert await until(lambda: idle not in clients.records)
    assert writing in clients.records, "the peer was forgotten under a running write"
    clients.backend.busy.clear()
    assert await until(lambda: writing not in clients.records)


async def test_close_stops_the_sweeper_and_gives_back_every_handshake(peers):
    clients = Sender(idle_s=60.0)
    for n, (_, address) in enumerate(peers):
        await session(clients, address, f"decode/{n}")
    assert sweepers() == 1
    await asyncio.wait_for(clients.close(), TIMEOUT)
    assert sweepers() == 0
    assert clients.backend.disconnects == Counter({"p0@1": 1, "p1@1": 1, "p2@1": 1})
