"""Memory a server hands over cannot take the broker down (kvbroker/memory/mapping.py).

A segment shrunk after registration fails its own engine's transfers with FAILED_PRECONDITION
naming it, on the receiving and on the sending side, and every other engine on the broker keeps
moving bytes. A /dev/shm too small for what is registered fails the registration with
RESOURCE_EXHAUSTED, and one that fills up later cannot fault a transfer into a registered segment.
When the kernel cannot back a page under a transfer engine's own copy (the race no check sees),
the SIGBUS guard absorbs it: the engine is failed, the broker lives.

UCX runs over tcp here (UCX_TLS=tcp), where its progress thread copies the bytes itself; Mooncake
runs over tcp. A broker with a small /dev/shm runs in a private mount namespace with a tmpfs of its
own, which the test reaches as a server would, by /proc/<pid>/root/dev/shm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import secrets
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from kvbroker_tools.launch import start_broker
from tests.support.brokers import (
    ALL,
    SMALL,
    Broker,
    Engine,
    assert_bytes,
    close_broker,
    expected_after,
    run_engines_in_child,
)
from tests.support.flows import grant, transfer
from tests.support.helpers import descriptor_rows
from tests.support.helpers import rpc_refusal as refused

pytestmark = pytest.mark.integration

TCP = {"UCX_TLS": "tcp"}
SMALL_SHM_BYTES = 5 << 20
IN_SMALL_SHM = ["unshare", "-m", "sh", "-c",
                f'mount -t tmpfs -o size={SMALL_SHM_BYTES},mode=1777 kvbt-shm /dev/shm && exec "$@"', "sh"]
IDS = list(range(8))
LARGER_THAN_SMALL_SHM = dataclasses.replace(SMALL, name="larger", num_pages=SMALL.num_pages * 64)  # 15.7 MB


async def tcp_broker(name: str, backend: str, prefix=(), env=TCP) -> Broker:
    process = await start_broker(name, "--backend", backend, "--log-level", "WARNING", env=env, prefix=prefix)
    channel = grpc.aio.insecure_channel(process.listen)
    return Broker(process, channel, bpb_grpc.BrokerServiceStub(channel))


@pytest.fixture
async def pair(backend):
    """Brokers of this test's own (one of them may die), the decode one with a 5 MiB /dev/shm."""
    made = [await tcp_broker(f"prefill-mem-{backend}", backend),
            await tcp_broker(f"decode-mem-{backend}", backend, prefix=IN_SMALL_SHM)]
    yield made
    for broker in made:
        broker.process.kill()
        await close_broker(broker)


@pytest.fixture
async def default_pair():
    """NIXL brokers on UCX's default transports (shared memory and cma on one host), the decode one
    with a 5 MiB /dev/shm."""
    made = [await tcp_broker("prefill-mem-ucx", "nixl", env={}),
            await tcp_broker("decode-mem-ucx", "nixl", prefix=IN_SMALL_SHM, env={})]
    yield made
    for broker in made:
        broker.process.kill()
        await close_broker(broker)


def shm_of(broker: Broker) -> Path:
    """The /dev/shm the broker sees."""
    return Path(f"/proc/{broker.process.pid}/root/dev/shm")


class ServerSegment:
    """A segment as a server makes one, in the /dev/shm `directory`: allocated, or sparse (ftruncate only)."""

    def __init__(self, directory: Path, size: int, *, allocate: bool) -> None:
        self.name = f"kvbt-mem-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = directory / self.name
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            if allocate:
                os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def shrink(self) -> None:
        """What a buggy server does after registering: the broker's mapping of it loses every page."""
        os.truncate(self.path, 0)

    def punch(self) -> None:
        """Give every page back to tmpfs (MADV_REMOVE): the size stays, the pages must be found again."""
        self._mmap.madvise(mmap.MADV_REMOVE, 0, self.size)

    def close(self) -> None:
        self.array = None
        self._mmap.close()
        self.path.unlink(missing_ok=True)


def fill_up(directory: Path) -> Path:
    """Write a file into `directory` until its filesystem is full."""
    path = directory / f"kvbt-filler-{os.getpid()}-{secrets.token_hex(4)}"
    chunk = b"\xff" * (64 << 10)
    with open(path, "wb", buffering=0) as f:
        for _ in range(1 << 14):  # 1 GiB at most: far more than any tmpfs here
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return path
    raise AssertionError(f"{directory} did not fill up")


class Engines:
    """Engines registered over ServerSegments, released (and their segments removed) at the end."""

    def __init__(self) -> None:
        self._made: list[Engine] = []

    async def make(self, broker: Broker, role: str, *, fill: str = "canary", allocate: bool = True,
                   seed: int = 0, shape: shapes.ModelShape = SMALL) -> Engine:
        placements = shapes.place_buffers(shape)
        segment = ServerSegment(shm_of(broker), shapes.pool_size(shape, placements), allocate=allocate)
        if fill == "random":
            shapes.fill_random(segment.array, np.random.default_rng(seed))
        elif fill == "canary":
            segment.array[:] = shapes.CANARY
        engine_id = f"{role}-{segment.name}/tp0"
        engine = Engine(broker, engine_id, shape, segment, placements)
        self._made.append(engine)
        await broker.stub.RegisterEngine(shapes.register_request(engine_id, shape, segment, placements), timeout=30)
        return engine

    def last_segment(self) -> ServerSegment:
        return self._made[-1].segment

    async def close(self) -> None:
        for engine in self._made:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await engine.stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=engine.engine_id),
                                                   timeout=30)
            engine.segment.close()


@pytest.fixture
async def servers():
    made = Engines()
    yield made
    await made.close()


async def assert_serving(broker: Broker) -> None:
    assert broker.process.process.returncode is None, f"the broker died ({broker.process.process.returncode})"
    reply = await health_pb2_grpc.HealthStub(broker.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def assert_moves(src: Engine, dst: Engine, request_id: str, before: np.ndarray | None = None) -> None:
    """A transfer from src to dst succeeds, every destination byte verified."""
    before = dst.segment.array.copy() if before is None else before
    await grant(dst, request_id, IDS[::-1])
    reply = await transfer(src, dst, request_id, IDS)
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED, reply
    assert_bytes(dst, expected_after(src, dst, before, ALL, IDS, IDS[::-1]))


async def test_a_receiver_segment_shrunk_after_registration_fails_its_engine_and_not_the_broker(
        pair, servers, request_id):
    prefill, decode = pair
    src = await servers.make(prefill, "prefill", fill="random")
    victim = await servers.make(decode, "decode")
    other = await servers.make(decode, "decode")
    await grant(victim, request_id, IDS)
    victim.segment.shrink()

    error = await refused(transfer(src, victim, request_id, IDS))
    await assert_serving(decode)
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert f"segment {victim.segment.name!r} was shrunk after registration" in error.details()
    error = await refused(grant(victim, request_id + "-again", IDS))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION and victim.segment.name in error.details()
    await assert_moves(src, other, request_id + "-other")


async def test_a_sender_segment_shrunk_after_registration_fails_its_engine_and_not_the_broker(
        pair, servers, request_id):
    decode, prefill = pair  # the sender is the broker with the small /dev/shm: its segments are in reach
    victim = await servers.make(prefill, "prefill", fill="random")
    other = await servers.make(prefill, "prefill", fill="random", seed=1)
    dst = await servers.make(decode, "decode")
    await grant(dst, request_id, IDS)
    victim.segment.shrink()

    error = await refused(transfer(victim, dst, request_id, IDS))
    await assert_serving(prefill)
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert f"segment {victim.segment.name!r} was shrunk after registration" in error.details()
    await assert_moves(other, dst, request_id + "-other")


async def test_registering_more_than_dev_shm_holds_is_resource_exhausted_and_the_broker_serves_on(
        pair, servers, request_id):
    prefill, decode = pair
    error = await refused(servers.make(decode, "decode", fill="none", allocate=False, shape=LARGER_THAN_SMALL_SHM))
    sparse = servers.last_segment()
    sparse.close()  # the server gives up on it: what the broker allocated of it goes with it
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert f"segment {sparse.name!r}" in error.details() and "/dev/shm" in error.details()
    assert "sizeLimit" in error.details()
    await assert_serving(decode)
    src = await servers.make(prefill, "prefill", fill="random")
    await assert_moves(src, await servers.make(decode, "decode"), request_id)


async def test_a_sparse_segment_is_allocated_at_registration_so_a_full_dev_shm_cannot_fault_a_transfer(
        pair, servers, request_id):
    prefill, decode = pair
    src = await servers.make(prefill, "prefill", fill="random")
    dst = await servers.make(decode, "decode", fill="none", allocate=False)  # zeros, and no page allocated
    before = np.zeros(dst.segment.size, dtype=np.uint8)  # not read: reading a hole allocates its page
    filler = fill_up(shm_of(decode))
    try:
        await grant(dst, request_id, IDS[::-1])
        reply = await transfer(src, dst, request_id, IDS)
    finally:
        await assert_serving(decode)
        filler.unlink()  # room for the pages of the unregistered tail, which the check below reads
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED, reply
    assert_bytes(dst, expected_after(src, dst, before, ALL, IDS, IDS[::-1]))


async def test_pages_lost_under_a_full_dev_shm_fail_their_engine_and_not_the_broker(backend, pair, servers,
                                                                                  request_id):
    """The guard's case: the size checks pass, and the transfer engine's copy finds no page."""
    prefill, decode = pair
    src = await servers.make(prefill, "prefill", fill="random")
    victim = await servers.make(decode, "decode")
    other = await servers.make(decode, "decode")
    victim.segment.punch()
    filler = fill_up(shm_of(decode))
    try:
        await grant(victim, request_id, IDS)
        error = await refused(transfer(src, victim, request_id, IDS))
        await assert_serving(decode)
        if backend == "nixl":  # UCX's thread copied into the mapping itself: the guard took the fault
            assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error.details()
            assert f"segment {victim.segment.name!r} lost its memory after registration" in error.details()
            again = await refused(grant(victim, request_id + "-again", IDS))
            assert again.code() is grpc.StatusCode.FAILED_PRECONDITION and "lost its memory" in again.details()
        else:  # Mooncake receives with recv(2) into the mapping: the kernel says EFAULT, the engine fails
            assert error.code() is grpc.StatusCode.ABORTED, error.details()
        await assert_moves(src, other, request_id + "-other")
    finally:
        filler.unlink()


async def test_an_endpoint_lost_to_one_engines_pages_recovers_for_the_others(default_pair, servers, request_id):
    """On UCX's default transports a write into pages the kernel cannot back fails the whole UCX
    endpoint to the receiving broker (NIXL_ERR_REMOTE_DISCONNECT), which failed every later transfer
    to it, for any engine, for as long as the remote agent stayed loaded (over 60 s, up to
    peer_idle_s). The backend loads that agent afresh before its next transfer."""
    prefill, decode = default_pair
    src = await servers.make(prefill, "prefill", fill="random")
    victim = await servers.make(decode, "decode")
    other = await servers.make(decode, "decode")
    await assert_moves(src, other, request_id + "-before")  # the endpoint exists, and works
    victim.segment.punch()
    filler = fill_up(shm_of(decode))
    try:
        await grant(victim, request_id, IDS)
        error = await refused(transfer(src, victim, request_id, IDS))
        assert error.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION), error.details()
    finally:
        filler.unlink()
    await assert_serving(decode)
    for n in range(2):  # at once, and again: no retry hides a broken path
        await assert_moves(src, other, f"{request_id}-after-{n}")


async def test_a_hard_link_to_another_engines_segment_is_an_overlap(brokers, servers):
    prefill = brokers.prefill
    first = await servers.make(prefill, "prefill")
    link = first.segment.path.with_name(first.segment.name + "-link")
    os.link(first.segment.path, link)
    try:
        request = shapes.register_request("prefill-link/tp0", SMALL, first.segment, first.placements)
        for component in request.components:
            for buffer in component.layer_buffers:
                buffer.memory.shared_memory.name = link.name
        error = await refused(prefill.stub.RegisterEngine(request, timeout=30))
    finally:
        link.unlink()
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert f"of engine {first.engine_id!r} in segment {link.name!r} (the same file as segment " \
           f"{first.segment.name!r}: a hard link)" in error.details()


async def copy_into_shrunk_segments(backend: str) -> dict:
    """The race no check sees, without a broker around it: a transfer engine writes out of and into
    segments shrunk after they were mapped. Run in a child (run_engines_in_child)."""
    import asyncio

    from kvbroker.backends import create_backend
    from kvbroker.config import Settings
    from kvbroker.core.errors import BrokerError
    from kvbroker.core.model import Descriptors, Region
    from kvbroker.memory.mapping import map_shared_memory

    os.environ.update(TCP)
    settings = Settings(backend=backend, listen="127.0.0.1:0", peer_listen="127.0.0.1:0")
    sender = create_backend(settings, f"sender-{os.getpid()}")
    receiver = create_backend(settings, f"receiver-{os.getpid()}")
    size, length = 4 << 20, 1 << 16
    files: dict[str, ServerSegment] = {}
    mapped = {}
    seen: dict = {}

    async def write(src: str, dst: str) -> dict:
        offsets = np.arange(size // length) * length
        rows = Descriptors(descriptor_rows(mapped[src].address, offsets, length),
                           descriptor_rows(mapped[dst].address, offsets, length))
        try:
            await sender.write(peer, rows, timeout=30)
            outcome = "written"
        except Exception as exc:  # the engine's own failure: EFAULT from a socket call
            outcome = f"{type(exc).__name__}: {exc}"
        result = {"outcome": outcome}
        for side in (src, dst):
            try:
                mapped[side].check_intact()
                result[side] = "intact"
            except BrokerError as exc:
                result[side] = [exc.code.name, exc.reason, mapped[side].poisoned]
        return result

    try:
        for side in ("src", "dst", "src2", "dst2"):
            files[side] = ServerSegment(Path("/dev/shm"), size, allocate=True)
            mapped[side] = map_shared_memory(files[side].name, side)
            mapped[side].reserve(0, size, "test")
        async with asyncio.timeout(90):
            await asyncio.gather(sender.start(), receiver.start())
            await sender.register([Region(mapped[s].address, size, 0, gpu=False) for s in ("src", "src2")])
            await receiver.register([Region(mapped[s].address, size, 0, gpu=False) for s in ("dst", "dst2")])
            peer = await sender.connect(await receiver.metadata())
            files["dst"].shrink()
            seen["into_shrunk"] = await write("src", "dst")
            files["src2"].shrink()
            seen["out_of_shrunk"] = await write("src2", "dst2")
    finally:
        async with asyncio.timeout(60):
            await asyncio.gather(sender.close(), receiver.close())
        for f in files.values():
            f.close()
    return seen


async def test_a_transfer_engine_copying_into_or_out_of_a_shrunk_segment_leaves_the_process_alive(backend):
    seen = await run_engines_in_child("tests.integration.test_memory_safety", "copy_into_shrunk_segments",
                                      backend, 150)
    into, out = seen["into_shrunk"], seen["out_of_shrunk"]
    assert into["src"] == "intact" and out["dst2"] == "intact", seen
    for result, side in ((into, "dst"), (out, "src2")):
        code, message, poisoned = result[side]
        assert code == "FAILED_PRECONDITION", seen
        assert ("lost its memory" if poisoned else "was shrunk after registration") in message
    if backend == "nixl":  # UCX's progress thread copied into the mapping: SIGBUS, absorbed by the guard
        assert into["dst"][2], seen
