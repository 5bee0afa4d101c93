"""Every RPC of BrokerService and PeerService, fuzzed with hypothesis on a real pair of brokers.

Each test drives one RPC with requests built from a valid seed and a few random mutations of any
field, nested or repeated: ids empty, very long or odd, page ids up to uint32 max, empty and
duplicated lists, unknown enum values, missing messages, random bytes and tokens. After every
call: the status is OK or one DESIGN.md documents (or RESOURCE_EXHAUSTED, CANCELLED), never
UNKNOWN or INTERNAL; both brokers are alive and SERVING; the canary engine's memory differs from
the canary only where a granted transfer that succeeded wrote (or, for a transfer a session's end
may cut short after its write, where the grant allowed). After each test a legitimate
transfer into the canary engine still moves every byte. One test plays a lying peer broker; one
holds engines under OpenSession streams and ends them under registrations, grants and transfers;
one sends watches, grants followed to their end (expect_watch), pings and cancels (good, bad and
floods of them) on Exchange streams.

Hypothesis drives synchronous code, so each test runs its @given function in a worker thread
with blocking stubs while the session loop keeps draining the brokers' pipes. Examples are
derandomized (profile "fuzz-ci"); KVBROKER_FUZZ_EXAMPLES sets how many per RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import pytest_asyncio
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from kvbroker_tools import shapes
from tests.support.brokers import (
    ALL,
    SMALL,
    Broker,
    Engine,
    Engines,
    assert_bytes,
    close_broker,
    close_brokers,
    expected_after,
    open_broker,
)
from tests.support.peer_side import real_handshake

pytestmark = pytest.mark.integration

settings.register_profile(
    "fuzz-ci", max_examples=int(os.environ.get("KVBROKER_FUZZ_EXAMPLES", "150")), derandomize=True,
    database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
FUZZ = settings(settings.get_profile("fuzz-ci"))

DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
}
CALL_TIMEOUT_S = 30.0  # well above the brokers' own bounds below: a call that reaches it hung
BROKER_FLAGS = ("--transfer-timeout-s", "10", "--peer-rpc-timeout-s", "2", "--unregister-wait-s", "2")
SCRATCH_SLOTS = 8
SCRATCH_SLOT = shapes.pool_size(SMALL, shapes.place_buffers(SMALL))
TERMINAL = (pb.TRANSFER_STATE_SUCCEEDED, pb.TRANSFER_STATE_FAILED)

U32 = st.one_of(st.integers(0, 70), st.sampled_from([127, 128, 2**31 - 1, 2**31, 2**32 - 1]),
                st.integers(0, 2**32 - 1))
U64 = st.one_of(U32, st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
I32 = st.one_of(st.integers(-3, 20), st.sampled_from([-2**31, 2**31 - 1]), st.integers(-2**31, 2**31 - 1))
ENUM = st.one_of(st.integers(0, 4), st.integers(-2**31, 2**31 - 1))  # proto3 enums are open
LONG = st.builds(lambda piece, n: piece * n, st.sampled_from(["a", "é", "/", "\x00", "🙂", "a.b-"]),
                 st.integers(129, 5000))
ODD = st.one_of(st.just(""), st.text(max_size=24), LONG, st.from_regex(r"[A-Za-z0-9._:/-]{1,128}", fullmatch=True))
COMPONENTS = st.lists(st.sampled_from(ALL), min_size=1, max_size=2, unique=True)
PAGES = st.lists(st.integers(0, SMALL.num_pages - 1), min_size=1, max_size=24, unique=True)


# -- the world: two brokers, a source engine, a canary engine with a pending grant -----------------

@dataclass
class World:
    backend: str
    prefill: Broker
    decode: Broker
    src: Engine  # on prefill, random bytes
    canary: Engine  # on decode, all canary: the memory nothing but a granted transfer may write
    scratch: SharedSegment  # what fuzzed registrations may map
    known: list[str]  # ids, names and addresses that fuzzed string fields draw from
    grants: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # canary's: components, pages
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)  # claim tokens ClaimGrant handed out
    written: np.ndarray | None = None  # canary bytes a successful fuzzed transfer may have written
    registered: list[str] = field(default_factory=list)  # engines fuzzed registrations created
    bystanders: list[Broker] = field(default_factory=list)  # more brokers a test involves, kept alive too
    numbers: itertools.count = field(default_factory=itertools.count)

    @property
    def protected(self) -> set[str]:
        return {self.src.engine_id, self.canary.engine_id}

    def allow_write(self, components, dst_ids) -> None:
        for p in self.canary.placements:
            if p.component in components:
                for page in dst_ids:
                    start = p.offset + page * p.item_len
                    self.written[start:start + p.item_len] = True


@pytest_asyncio.fixture(scope="module")
async def world(backend):
    prefill = await open_broker(f"fuzz-prefill-{backend}", backend, *BROKER_FLAGS)
    decode = await open_broker(f"fuzz-decode-{backend}", backend, *BROKER_FLAGS)
    made = Engines()
    scratch = SharedSegment.create(SCRATCH_SLOTS * SCRATCH_SLOT, "kvbt-fuzz")
    try:
        src = await made.make(prefill, "prefill")
        canary = await made.make(decode, "decode", fill="canary")
        known = [src.engine_id, canary.engine_id, "fuzz-pending", "r-0", "r-1", "r-2", scratch.name,
                 prefill.peer_address, decode.peer_address, decode.process.listen, "127.0.0.1:1",
                 "unix:/nonexistent/kvbroker.sock", "nixl", "mooncake", prefill.process.broker_id,
                 decode.process.broker_id]
        w = World(backend, prefill, decode, src, canary, scratch, known)
        w.written = np.zeros(canary.segment.array.size, dtype=bool)
        pending = list(range(0, SMALL.num_pages, 2))
        await canary.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id="fuzz-pending", engine_id=canary.engine_id, components=ALL, dst_page_ids=pending,
            expiry_ms=600_000), timeout=10)
        w.grants["fuzz-pending"] = (list(ALL), pending)
        yield w
    finally:
        await made.close()
        scratch.close()
        scratch.unlink()
        codes = await close_brokers(prefill, decode)
    assert codes == [0, 0], f"a fuzzed broker did not shut down cleanly: exit codes {codes}"


class Fuzzer:
    """Blocking stubs for one test, made and used in the worker thread; checks after every call."""

    def __init__(self, world: World) -> None:
        self.w = world
        self.channels = {}
        for name, address in (("prefill", world.prefill.process.listen), ("decode", world.decode.process.listen),
                              ("prefill_peer", world.prefill.peer_address),
                              ("decode_peer", world.decode.peer_address)):
            self.channels[name] = grpc.insecure_channel(address)
        self.local = {"prefill": bpb_grpc.BrokerServiceStub(self.channels["prefill"]),
                      "decode": bpb_grpc.BrokerServiceStub(self.channels["decode"])}
        self.peer = {"prefill": ppb_grpc.PeerServiceStub(self.channels["prefill_peer"]),
                     "decode": ppb_grpc.PeerServiceStub(self.channels["decode_peer"])}
        for i, broker in enumerate(world.bystanders):
            self.channels[f"bystander{i}"] = grpc.insecure_channel(broker.process.listen)
        self.health = [health_pb2_grpc.HealthStub(c) for c in self.channels.values()]
        self.crash: str | None = None
        self.outcomes: Counter[str] = Counter()  # printed: shows how deep the examples reached

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def call(self, method, request, what: str):
        """One unary call: (reply, None) or (None, code); fails on an undocumented code or a hang."""
        started = time.monotonic()
        try:
            reply, code, details = method(request, timeout=CALL_TIMEOUT_S), None, ""
        except grpc.RpcError as exc:
            reply, code, details = None, exc.code(), exc.details()
        self.check_alive(what, request)
        self.outcomes[f"{what.split()[0]} {code.name if code else 'OK'}"] += 1
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started >= CALL_TIMEOUT_S - 1:
            pytest.fail(f"{what} hung for {CALL_TIMEOUT_S}s on\n{request!r:.3000}")
        if code is not None and code not in DOCUMENTED:
            pytest.fail(f"{what} answered {code.name} ({details}) to\n{request!r:.3000}")
        return reply, code

    def check_alive(self, what: str, request) -> None:
        if self.crash is None:
            for broker in (self.w.prefill, self.w.decode, *self.w.bystanders):
                if broker.process.process.returncode is not None:
                    self.crash = broker.process.exit_report(f"after {what} with\n{request!r:.3000}\n")
            for stub in self.health:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                except grpc.RpcError as exc:
                    status = exc.code()
                if status != health_pb2.HealthCheckResponse.SERVING and self.crash is None:
                    self.crash = f"health is {status} after {what} with\n{request!r:.3000}"
        if self.crash is not None:
            pytest.fail(self.crash)  # shrinking replays against a dead broker; this names the first culprit

    def state(self, where: str, engine_id: str, request_id: str) -> int | None:
        """The request's current state (first message of WatchTransfer), None when it is not there."""
        call = self.local[where].WatchTransfer(
            bpb.WatchTransferRequest(engine_id=engine_id, request_id=request_id), timeout=10)
        try:
            return next(call).status.state
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), exc
            return None
        finally:
            call.cancel()

    # -- setup steps some examples take before the fuzzed call -----------------------------------
    def grant(self, where: str, engine: Engine, request_id: str, components, pages, expiry_ms=30_000) -> None:
        request = bpb.ExpectTransferRequest(request_id=request_id, engine_id=engine.engine_id,
                                            components=components, dst_page_ids=pages, expiry_ms=expiry_ms)
        self.expect_transfer(where, request)

    def expect_transfer(self, where: str, request: bpb.ExpectTransferRequest):
        reply, code = self.call(self.local[where].ExpectTransfer, request, "ExpectTransfer")
        if reply is not None and where == "decode" and request.engine_id == self.w.canary.engine_id:
            self.w.grants[request.request_id] = (list(request.components), list(request.dst_page_ids))
        return reply, code

    def claim(self, request: ppb.ClaimGrantRequest):
        reply, code = self.call(self.peer["decode"].ClaimGrant, request, "ClaimGrant")
        if reply is not None:
            self.w.tokens[(request.engine_id, request.request_id)] = reply.claim_token
        return reply, code


def fuzz(world: World, test) -> None:
    """Run a @given test taking (fuzzer, data) in a worker thread, on stubs of its own."""
    fuzzer = Fuzzer(world)
    try:
        test(fuzzer)
        print(dict(sorted(fuzzer.outcomes.items())))
    finally:
        fuzzer.close()


async def run_fuzz(world: World, test) -> None:
    await asyncio.to_thread(fuzz, world, test)
    await check_canary_and_legit_transfer(world)


async def check_canary_and_legit_transfer(w: World) -> None:
    """Canary bytes outside what successful transfers wrote; then a real transfer still works."""
    array = w.canary.segment.array
    touched = np.flatnonzero((array != shapes.CANARY) & ~w.written)
    assert touched.size == 0, f"{touched.size} canary bytes changed without a granted transfer, first at {touched[0]}"
    array[:] = shapes.CANARY
    w.written[:] = False
    request_id = f"legit-{next(w.numbers)}"
    rng = np.random.default_rng(len(request_id))
    src_ids, dst_ids = rng.permutation(SMALL.num_pages)[:16], rng.permutation(SMALL.num_pages)[:16]
    await w.canary.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=w.canary.engine_id, components=ALL, dst_page_ids=dst_ids.tolist()),
        timeout=10)
    reply = await w.src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=w.src.engine_id, peer_address=w.decode.peer_address,
        remote_engine_id=w.canary.engine_id, components=ALL, src_page_ids=src_ids.tolist()), timeout=60)
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED
    before = np.full_like(array, shapes.CANARY)
    assert_bytes(w.canary, expected_after(w.src, w.canary, before, ALL, src_ids, dst_ids))
    array[:] = shapes.CANARY


# -- generic mutation of any message, driven by its descriptor ---------------------------------------

def one_of_pool(pool: list):
    """An element of a list that grows during the test: the choice drawn is an index, so it replays."""
    return st.integers(0, 255).map(lambda i: pool[i % len(pool)])


def scalar(fd, known: list[str]):
    if fd.type == F.TYPE_STRING:
        return st.one_of(one_of_pool(known), ODD)
    if fd.type == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=256), st.sampled_from([b"127.0.0.1:1", b"[::1]:1", b"host:x"]))
    if fd.type == F.TYPE_BOOL:
        return st.booleans()
    if fd.type == F.TYPE_ENUM:
        return ENUM
    if fd.type == F.TYPE_UINT32:
        return U32
    if fd.type == F.TYPE_UINT64:
        return U64
    if fd.type == F.TYPE_INT32:
        return I32
    raise AssertionError(f"no strategy for field type {fd.type} of {fd.full_name}")


def mutate_once(data, message, known: list[str]) -> None:
    fd = data.draw(st.sampled_from(list(message.DESCRIPTOR.fields)))
    value = getattr(message, fd.name)
    is_message = fd.message_type is not None
    if fd.is_repeated:
        action = data.draw(st.sampled_from(["clear", "append", "duplicate", "element", "many"]))
        if action == "clear":
            message.ClearField(fd.name)
        elif action == "duplicate" and len(value):
            for item in list(value)[: data.draw(st.integers(1, len(value)))]:
                if is_message:
                    value.add().CopyFrom(item)
                else:
                    value.append(item)
        elif action == "element" and len(value):
            i = data.draw(st.integers(0, len(value) - 1))
            if is_message:
                mutate_once(data, value[i], known)
            else:
                value[i] = data.draw(scalar(fd, known))
        elif action == "many" and fd.type in (F.TYPE_UINT32, F.TYPE_ENUM):
            start, count = data.draw(st.integers(0, 2**31)), data.draw(st.integers(100, 5000))
            if fd.type == F.TYPE_ENUM:  # an enum value is an int32: past it the stub raises, nothing is sent
                start = min(start, 2**31 - count)
            value.extend(range(start, start + count))
        elif is_message:
            item = value.add()
            for _ in range(data.draw(st.integers(0, 3))):
                mutate_once(data, item, known)
        else:
            value.append(data.draw(scalar(fd, known)))
    elif is_message:
        if data.draw(st.booleans()) or not value.DESCRIPTOR.fields:
            message.ClearField(fd.name)  # a missing message
        else:
            mutate_once(data, value, known)
    else:
        setattr(message, fd.name, data.draw(scalar(fd, known)))


def mutated(data, message, known: list[str], most: int = 4):
    for _ in range(data.draw(st.integers(0, most), label="mutations")):
        mutate_once(data, message, known)
    return message


# -- BrokerService ---------------------------------------------------------------------------------

def register_seed(data, w: World, segment: SharedSegment | None = None,
                  slot: int | None = None) -> bpb.RegisterEngineRequest:
    """A valid registration of a fresh engine over one slot of `segment` (the world's scratch, a
    drawn slot, unless told)."""
    names = data.draw(st.sampled_from([("MAIN_KV", "MINIMAX_INDEX_K"), ("MAIN_KV",), ("MINIMAX_INDEX_K",)]))
    layout = data.draw(st.sampled_from(["KV_SPLIT", "FLAT"]))
    placements = shapes.place_buffers(SMALL, names, layout)
    engine_id = f"fuzz-{next(w.numbers)}/tp0"
    request = shapes.register_request(engine_id, SMALL, segment or w.scratch, placements, layout)
    base = (data.draw(st.integers(0, SCRATCH_SLOTS - 1)) if slot is None else slot) * SCRATCH_SLOT
    for component in request.components:
        for buffer in component.layer_buffers:
            buffer.memory.shared_memory.offset += base
    return request


async def test_fuzz_register_engine(world):
    @FUZZ
    @given(st.data(), st.sampled_from(["prefill", "decode"]))
    def run(fuzzer, data, where):
        request = mutated(data, register_seed(data, fuzzer.w), fuzzer.w.known, most=5)
        keep = data.draw(st.booleans())  # keep some, so the other RPCs meet fuzzed engines too
        reply, _ = fuzzer.call(fuzzer.local[where].RegisterEngine, request, "RegisterEngine")
        if reply is not None:
            assert reply.engine.engine_id == request.engine_id
            fuzzer.w.registered.append(request.engine_id)
            fuzzer.w.known.append(request.engine_id)
            if not keep:
                fuzzer.call(fuzzer.local[where].UnregisterEngine,
                            bpb.UnregisterEngineRequest(engine_id=request.engine_id), "UnregisterEngine")

    await run_fuzz(world, run)


async def test_fuzz_unregister_engine(world):
    @FUZZ
    @given(st.data(), st.sampled_from(["prefill", "decode"]))
    def run(fuzzer, data, where):
        w = fuzzer.w
        engine_id = data.draw(st.one_of(one_of_pool(w.registered or ["none"]), ODD))
        request = mutated(data, bpb.UnregisterEngineRequest(engine_id=engine_id), w.known, most=1)
        assume(request.engine_id not in w.protected)
        fuzzer.call(fuzzer.local[where].UnregisterEngine, request, "UnregisterEngine")

    await run_fuzz(world, run)


def expect_seed(data, w: World) -> tuple[str, bpb.ExpectTransferRequest]:
    where, engine = data.draw(st.sampled_from([("decode", w.canary), ("prefill", w.src)]))
    request_id = data.draw(st.one_of(st.sampled_from(["r-0", "r-1", "r-2", "fuzz-pending"]),
                                     st.builds(lambda: f"g-{next(w.numbers)}")))
    return where, bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=engine.engine_id, components=data.draw(COMPONENTS),
        dst_page_ids=data.draw(PAGES), expiry_ms=data.draw(st.sampled_from([0, 1, 50, 30_000, 600_000])))


async def test_fuzz_expect_transfer(world):
    @FUZZ
    @given(st.data())
    def run(fuzzer, data):
        where, seed = expect_seed(data, fuzzer.w)
        fuzzer.expect_transfer(where, mutated(data, seed, fuzzer.w.known))

    await run_fuzz(world, run)


def transfer_call(fuzzer: Fuzzer, where: str, request: bpb.TransferRequest):
    reply, code = fuzzer.call(fuzzer.local[where].Transfer, request, "Transfer")
    w = fuzzer.w
    if reply is not None and request.remote_engine_id == w.canary.engine_id:
        assert request.request_id in w.grants, f"a transfer succeeded without a grant the test made: {request}"
        granted_components, granted = w.grants[request.request_id]
        assert set(request.components) <= set(granted_components), f"components outside the grant: {request}"
        pages = list(request.dst_page_ids) or granted
        assert set(pages) <= set(granted), f"pages outside the grant were written: {request}"
        w.allow_write(request.components, pages[: len(request.src_page_ids)])
    return reply, code


async def test_fuzz_transfer(world):
    @FUZZ
    @given(st.data())
    def run(fuzzer, data):
        w = fuzzer.w
        fresh = f"t-{next(w.numbers)}"
        request_id = data.draw(st.sampled_from(["r-0", "r-1", "fuzz-pending", fresh, fresh, fresh]))
        components = data.draw(COMPONENTS)
        sender, (granter, receiver) = data.draw(st.sampled_from([
            ("prefill", ("decode", w.canary)), ("decode", ("prefill", w.src))]))
        local = w.src if sender == "prefill" else w.canary
        if data.draw(st.booleans()):
            fuzzer.grant(granter, receiver, request_id, components, data.draw(PAGES))
        peer = (w.decode if receiver is w.canary else w.prefill).peer_address
        seed = bpb.TransferRequest(
            request_id=request_id, engine_id=local.engine_id, peer_address=peer,
            remote_engine_id=receiver.engine_id, components=components, src_page_ids=data.draw(PAGES),
            dst_page_ids=data.draw(st.one_of(st.just([]), PAGES)))
        transfer_call(fuzzer, sender, mutated(data, seed, w.known))

    await run_fuzz(world, run)


async def test_fuzz_watch_transfer(world):
    @FUZZ
    @given(st.data(), st.sampled_from(["prefill", "decode"]))
    def run(fuzzer, data, where):
        w = fuzzer.w
        seed = bpb.WatchTransferRequest(engine_id=data.draw(st.sampled_from([w.canary.engine_id, w.src.engine_id])),
                                        request_id=data.draw(st.sampled_from(["r-0", "r-1", "fuzz-pending"])))
        request = mutated(data, seed, w.known, most=2)
        request.offer_wait_ms = min(request.offer_wait_ms, 50)  # bounded by offer_wait_s; the budget is examples
        # terminal_only: nothing comes until the request ends, so a live one runs into the deadline
        end_only = request.terminal_only
        call = fuzzer.local[where].WatchTransfer(request, timeout=1 if end_only else 10)
        try:
            first = next(call).status
            fuzzer.outcomes[f"WatchTransfer {pb.TransferState.Name(first.state)}"] += 1
            if first.state in TERMINAL:
                rest = list(call)  # the stream ends after a terminal state; a hang runs into the timeout
                assert rest == [], f"updates after the terminal state: {rest}"
            else:
                assert not end_only, f"a terminal_only watch sent {first}"
                assert first.state in (pb.TRANSFER_STATE_PENDING, pb.TRANSFER_STATE_TRANSFERRING), first
        except grpc.RpcError as exc:
            fuzzer.outcomes[f"WatchTransfer {exc.code().name}"] += 1
            allowed = DOCUMENTED if end_only else DOCUMENTED - {grpc.StatusCode.DEADLINE_EXCEEDED}
            assert exc.code() in allowed, \
                f"WatchTransfer answered {exc.code().name} ({exc.details()}) to\n{request!r:.3000}"
        finally:
            call.cancel()
            fuzzer.check_alive("WatchTransfer", request)

    await run_fuzz(world, run)


async def test_fuzz_cancel_transfer(world):
    @FUZZ
    @given(st.data(), st.sampled_from(["prefill", "decode"]))
    def run(fuzzer, data, where):
        w = fuzzer.w
        seed = bpb.CancelTransferRequest(
            engine_id=data.draw(st.sampled_from([w.canary.engine_id, w.src.engine_id])),
            request_id=data.draw(st.sampled_from(["r-0", "r-1", "r-2"])), reason=data.draw(ODD))
        request = mutated(data, seed, w.known, most=2)
        request.offer_wait_ms = min(request.offer_wait_ms, 50)  # bounded by offer_wait_s; the budget is examples
        reply, _ = fuzzer.call(fuzzer.local[where].CancelTransfer, request, "CancelTransfer")
        if reply is not None:
            assert reply.status.state in TERMINAL

    await run_fuzz(world, run)


# -- the Exchange stream's cancel: a command named by its id ends, a bad cancel gets its status -------

CODE_NAMES = {code.value[0]: code for code in grpc.StatusCode}
WATCH_TIMEOUTS_MS = st.sampled_from([0, 0, 1, 50, 200])


def last_reply(reply: bpb.ExchangeResponse) -> bool:
    """Whether `reply` is its command's last: an error, a pong, a cancel's answer, a terminal status
    (an expect_watch's `expect` reply is followed by its watch's end)."""
    kind = reply.WhichOneof("reply")
    return kind not in ("watch", "expect") or (kind == "watch" and reply.watch.status.state in TERMINAL)


def cancel_target(data, kind: str, upcoming: int) -> int:
    """What a cancel sent as command `upcoming` names: a command sent before it, an id never sent, the
    command after it, 0, or itself."""
    if kind == "sent":
        return data.draw(st.integers(1, max(1, upcoming - 1)))
    if kind == "unknown":
        return data.draw(st.integers(1 << 32, 2**64 - 1 - 500))
    return {"later": upcoming + 1, "zero": 0}.get(kind, upcoming)


class ExchangeExample:
    """One Exchange stream of one example: the commands it sent (id → kind, a cancel's target), and
    every reply in the order the broker wrote them."""

    def __init__(self, fuzzer: Fuzzer, where: str) -> None:
        self.f, self.where = fuzzer, where
        self.requests: queue.Queue[bpb.ExchangeRequest | None] = queue.Queue()
        self.call = fuzzer.local[where].Exchange(iter(self.requests.get, None), timeout=CALL_TIMEOUT_S)
        self.sent: dict[int, str] = {}
        self.targets: dict[int, int] = {}  # cancel id → the id it names
        self.replies: list[bpb.ExchangeResponse] = []
        self.last: dict[int, int] = {}  # command id → the index of its last reply
        self.ids = itertools.count(1)

    def send(self, kind: str, **command) -> int:
        command_id = next(self.ids)
        self.sent[command_id] = kind
        self.requests.put(bpb.ExchangeRequest(command_id=command_id, **command))
        return command_id

    def cancel(self, target: int) -> int:
        command_id = self.send("cancel", cancel=bpb.ExchangeCancel(command_id=target))
        self.targets[command_id] = target
        return command_id

    def read_all(self) -> None:
        """Read until every command sent has its last reply (a reply that never comes runs into the call's
        deadline: a hang)."""
        while len(self.last) < len(self.sent):
            try:
                reply = next(self.call)
            except grpc.RpcError as exc:
                pytest.fail(f"the Exchange stream ended with {exc.code().name} ({exc.details()}) with "
                            f"{sorted(set(self.sent) - set(self.last))[:10]} unanswered")
            assert reply.command_id in self.sent, f"a reply to a command never sent: {reply}"
            assert reply.command_id not in self.last, f"a reply after command {reply.command_id}'s last: {reply}"
            if reply.WhichOneof("reply") == "error":
                code = CODE_NAMES.get(reply.error.code)
                name = code.name if code else reply.error.code
                self.f.outcomes[f"Exchange {self.sent[reply.command_id]} {name}"] += 1
                assert code in DOCUMENTED, f"Exchange answered {reply.error.code} ({reply.error.message})"
            if last_reply(reply):
                self.last[reply.command_id] = len(self.replies)
            self.replies.append(reply)

    def check_cancels(self) -> None:
        """Each cancel's answer: precise, and consistent with what became of the command it named."""
        cancelled = Counter()
        for cancel_id, target in self.targets.items():
            answer = self.replies[self.last[cancel_id]]
            kind = answer.WhichOneof("reply")
            if target in (0, cancel_id):
                assert kind == "error" and CODE_NAMES[answer.error.code] is grpc.StatusCode.INVALID_ARGUMENT, answer
                assert answer.error.message.startswith("cancel.command_id: "), answer
            elif target not in self.sent or target > cancel_id:
                assert kind == "error" and CODE_NAMES[answer.error.code] is grpc.StatusCode.NOT_FOUND, answer
                assert f"no command {target} is in flight" in answer.error.message, answer
            elif kind == "cancelled":
                assert answer.cancelled.command_id == target
                ended = self.replies[self.last[target]]
                assert self.last[target] < self.last[cancel_id], "a cancel answered before its command's last reply"
                assert CODE_NAMES[ended.error.code] is grpc.StatusCode.CANCELLED, ended
                cancelled[target] += 1
                self.f.outcomes["Exchange cancel took"] += 1
            else:  # it ended before the cancel was read: its last reply came first
                assert kind == "error" and CODE_NAMES[answer.error.code] is grpc.StatusCode.NOT_FOUND, answer
                assert self.last[target] < self.last[cancel_id], answer
        assert all(n == 1 for n in cancelled.values()), f"a command cancelled twice: {cancelled}"

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


async def test_fuzz_exchange_cancel(world):
    """Per example, on one Exchange stream: watches (drawn, maybe mutated, with deadlines or none),
    grants followed to their end (expect_watch: offered to the prefill broker, maybe mutated, with
    short expiries and deadlines; nothing writes into them) and pings, interleaved with cancels
    naming a command of the stream (in flight or ended), one never sent, one sent later, 0, the
    cancel itself, or floods of them; then a cancel of every watch and grant. Each command gets
    exactly one last reply, each cancel exactly one answer, as the cancel's rules say; the broker
    stays alive and serving."""
    @FUZZ
    @given(st.data(), st.sampled_from(["decode", "decode", "decode", "prefill"]))
    def run(fuzzer, data, where):
        w = fuzzer.w
        example = ExchangeExample(fuzzer, where)
        here, there = (w.canary, w.src) if where == "decode" else (w.src, w.canary)
        try:
            watches = []
            for _ in range(data.draw(st.integers(1, 10), label="steps")):
                step = data.draw(st.sampled_from(["watch", "watch", "grant", "ping", "cancel", "cancel", "flood"]))
                if step == "watch":  # mostly of the pending grant, which no watch sees end
                    seed = bpb.WatchTransferRequest(
                        engine_id=data.draw(st.sampled_from([here.engine_id] * 3 + [there.engine_id])),
                        request_id=data.draw(st.sampled_from(["fuzz-pending", "fuzz-pending", "r-0"])),
                        states_only=data.draw(st.booleans()), terminal_only=data.draw(st.booleans()))
                    request = mutated(data, seed, w.known, most=1)
                    request.offer_wait_ms = min(request.offer_wait_ms, 50)
                    watches.append(example.send("watch", watch=request, timeout_ms=data.draw(WATCH_TIMEOUTS_MS)))
                elif step == "grant":  # ids no transfer of the fuzzer draws: nothing writes into them
                    seed = bpb.ExpectTransferRequest(
                        request_id=f"ew-{next(w.numbers)}", engine_id=here.engine_id,
                        pages=[pb.ComponentPages(component=pb.COMPONENT_MAIN_KV, page_ids=data.draw(PAGES))],
                        sender_address=w.prefill.peer_address, sender_engine_id=w.src.engine_id,
                        expiry_ms=data.draw(st.sampled_from([1, 50, 200])))
                    request = mutated(data, seed, w.known, most=1)
                    request.request_id = seed.request_id
                    request.sender_address = seed.sender_address
                    watches.append(example.send("expect_watch", expect_watch=request,
                                                timeout_ms=data.draw(WATCH_TIMEOUTS_MS)))
                elif step == "ping":
                    example.send("ping", ping=bpb.ExchangePing(payload=data.draw(st.binary(max_size=64))))
                else:  # a flood: distinct unknown ids, or the same target again and again
                    count = data.draw(st.integers(50, 500)) if step == "flood" else 1
                    kind = data.draw(st.sampled_from(["sent", "sent", "unknown", "later", "zero", "self"]))
                    first = cancel_target(data, kind, len(example.sent) + 1)
                    for n in range(count):
                        upcoming = len(example.sent) + 1
                        example.cancel({"unknown": first + n, "self": upcoming}.get(kind, first))
            for watch_id in watches:  # leave nothing behind: a cancel of each watch, ended or not
                example.cancel(watch_id)
            example.read_all()
            example.check_cancels()
        finally:
            example.close()
        fuzzer.check_alive("Exchange", f"{len(example.sent)} commands")

    await run_fuzz(world, run)


def unknown_fields(draw_fields) -> bytes:
    """A protobuf encoding of fields the message does not declare (varints and byte strings)."""
    out = bytearray()

    def varint(n: int) -> None:
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return

    for number, payload in draw_fields:
        if isinstance(payload, int):
            varint(number << 3)
            varint(payload)
        else:
            varint(number << 3 | 2)
            varint(len(payload))
            out.extend(payload)
    return bytes(out)


async def test_fuzz_get_broker_info(world):
    payload = st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=64))
    fields = st.lists(st.tuples(st.integers(1, 2**29 - 1), payload), max_size=6)

    @FUZZ
    @given(fields, st.sampled_from(["prefill", "decode"]))
    def run(fuzzer, drawn, where):
        method = fuzzer.channels[where].unary_unary(
            "/kvbroker.v1.BrokerService/GetBrokerInfo", request_serializer=None,
            response_deserializer=bpb.GetBrokerInfoResponse.FromString)
        reply, _ = fuzzer.call(method, unknown_fields(drawn), "GetBrokerInfo")
        assert reply is not None
        engine = fuzzer.w.canary if where == "decode" else fuzzer.w.src
        assert engine.engine_id in {e.engine_id for e in reply.engines}

    await run_fuzz(world, run)


# -- sessions: an OpenSession stream holds engines; they go when it ends, and only they ----------------

SESSION_SLOTS = 64  # slots of the session test's own segment, taken in turn: no example meets the last's
RELEASE_DEADLINE_S = 10.0  # well above what a release may wait for writes: an engine still there was kept
MAX_HOLDER_CHARS = 128
HOLDERS = st.one_of(  # mostly valid, so that most examples hold engines; either side of the limit; ODD's
    st.text(max_size=40), st.text(max_size=40), st.text(max_size=40), ODD,
    st.builds(lambda piece, n: piece * n, st.sampled_from(["h", "é", "🙂", "\x00", " "]),
              st.integers(MAX_HOLDER_CHARS - 2, MAX_HOLDER_CHARS + 2)))
BROKERS = ("prefill", "decode")


@dataclass
class HeldSession:
    """An OpenSession stream on a connection of its own, and the engines it should hold."""

    where: str
    holder: str
    channel: grpc.Channel
    call: grpc.Call  # the stream: cancelling it, or closing the channel, ends the session
    session_id: str
    engines: set[str] = field(default_factory=set)


@dataclass
class EngineStep:
    """What an example does with one engine it registers, all drawn before any of it happens: the
    draws do not depend on the brokers' answers, so a failing example replays as it ran."""

    where: str
    request: bpb.RegisterEngineRequest
    unmutated: bool
    fate: str  # "keep", "unregister", or "again": unregister, then register the same id and memory again
    again_session_id: str
    grant_pages: list[int] | None  # a grant on it while its session is open
    send: tuple[list[int], list[int], list[int]] | None  # components, canary pages, source pages


@dataclass
class Watched:
    """A grant on a session-held engine, watched from PENDING to the state the session's end leaves."""

    session: HeldSession
    engine_id: str
    call: grpc.Call
    written: bool  # a transfer into it was started, so it may have SUCCEEDED before the session ended


class SessionExample:
    """One example of test_fuzz_sessions: its sessions, the engines it registered, and where each
    of them should be; `check_listing` holds GetBrokerInfo of both brokers against that model."""

    def __init__(self, fuzzer: Fuzzer, data, segment: SharedSegment, slots: itertools.count,
                 ended: list[str], reached: Counter, kept: list[str]) -> None:
        self.f, self.w, self.data, self.segment, self.slots = fuzzer, fuzzer.w, data, segment, slots
        self.ended = ended  # ids of the sessions this test ended, all examples
        self.reached = reached  # what the examples got to, all examples
        self.kept = kept  # the first release that did not happen, if one did not
        if kept:  # engines it kept skew every later example, and each costs a deadline: name the first
            pytest.fail(kept[0])
        self.open: list[HeldSession] = []
        self.engines: dict[tuple[str, str], str] = {}  # (broker, engine id) -> the session holding it, "" none
        self.mutated_ok: set[str] = set()  # brokers where a mutated registration holds memory a seed may overlap
        self.watched: list[Watched] = []
        self.transfers: list[tuple[grpc.Future, bpb.TransferRequest, float]] = []

    def known(self) -> list[str]:
        return [*self.w.known, *(s.session_id for s in self.open), *self.ended[-4:],
                *(engine_id for _, engine_id in self.engines)]

    def session_on(self, where: str, session_id: str) -> HeldSession | None:
        return next((s for s in self.open if s.where == where and s.session_id == session_id), None)

    # -- drawing --------------------------------------------------------------------------------
    def draw_place(self, where: str | None = None) -> tuple[str, str]:
        """A broker (`where`, unless drawn) and a session id to register under there: one open there,
        one open on the other broker, an ended one, garbage, or none."""
        kind = self.data.draw(st.sampled_from(["open", "open", "open", "open", "elsewhere", "none", "ended",
                                               "garbage"]))
        pick, drawn_where = self.data.draw(st.integers(0, 255)), self.data.draw(st.sampled_from(BROKERS))
        if kind in ("open", "elsewhere"):
            here = [s for s in self.open if where is None or (s.where == where) == (kind == "open")]
            if here:
                session = here[pick % len(here)]
                other = BROKERS[1 - BROKERS.index(session.where)]
                return where or (session.where if kind == "open" else other), session.session_id
        where = where or drawn_where
        if kind == "ended":
            return where, (self.ended or ["s-0000000000000000"])[pick % max(1, len(self.ended))]
        return where, self.data.draw(ODD) if kind == "garbage" else ""

    def fresh_request(self, session_id: str, mutate: bool) -> tuple[bpb.RegisterEngineRequest, bool]:
        """A new engine over the next slot, maybe mutated; and whether it is still the seed."""
        seed = register_seed(self.data, self.w, self.segment, next(self.slots) % SESSION_SLOTS)
        seed.session_id = session_id
        request = bpb.RegisterEngineRequest()
        request.CopyFrom(seed)
        if mutate:
            mutated(self.data, request, self.known(), most=2)
        return request, request == seed

    def draw_step(self) -> EngineStep:
        data = self.data
        where, session_id = self.draw_place()
        request, unmutated = self.fresh_request(session_id, mutate=data.draw(st.booleans()))
        fate = data.draw(st.sampled_from(["keep", "keep", "keep", "keep", "unregister", "again"]))
        _, again_session_id = self.draw_place(where)
        grant_pages = data.draw(st.one_of(st.none(), PAGES))
        send = data.draw(st.one_of(st.none(), st.tuples(COMPONENTS, PAGES, PAGES)))
        return EngineStep(where, request, unmutated, fate, again_session_id, grant_pages, send)

    # -- the steps ------------------------------------------------------------------------------
    def open_session(self, where: str, holder: str) -> None:
        address = (self.w.prefill if where == "prefill" else self.w.decode).process.listen
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        request = bpb.OpenSessionRequest(holder=holder)
        call = bpb_grpc.BrokerServiceStub(channel).OpenSession(request)
        watchdog = threading.Timer(CALL_TIMEOUT_S, call.cancel)  # the stream has no deadline: it is the session
        watchdog.start()
        try:
            session_id, code, details = next(call).session_id, None, ""
        except grpc.RpcError as exc:
            session_id, code, details = "", exc.code(), exc.details()
        finally:
            hung = not watchdog.is_alive()
            watchdog.cancel()
        self.f.check_alive("OpenSession", request)
        self.f.outcomes[f"OpenSession {code.name if code else 'OK'}"] += 1
        if code is not None:
            channel.close()
        if hung:
            pytest.fail(f"OpenSession sent no session id within {CALL_TIMEOUT_S}s to\n{request!r:.3000}")
        if len(holder) > MAX_HOLDER_CHARS:
            assert code is grpc.StatusCode.INVALID_ARGUMENT, \
                f"a holder of {len(holder)} characters got {code} ({details}), not INVALID_ARGUMENT"
            return
        if code is not None:
            pytest.fail(f"OpenSession answered {code.name} ({details}) to\n{request!r:.3000}")
        assert session_id, "the first OpenSession response carries no session id"
        self.open.append(HeldSession(where, holder, channel, call, session_id))

    def register(self, where: str, request: bpb.RegisterEngineRequest, unmutated: bool,
                 racing: HeldSession | None = None, issued: grpc.Future | None = None) -> bool:
        """Register (or collect the registration `issued` before): one under a session not open on
        `where` is refused, one `racing` its session's end may go either way; an unmutated one under
        an open session or none succeeds unless a mutated one holds memory it may overlap."""
        method = self.f.local[where].RegisterEngine if issued is None else lambda _, timeout: issued.result()
        reply, code = self.f.call(method, request, "RegisterEngine")
        session = self.session_on(where, request.session_id)
        if racing is not None:
            session = racing
            self.f.outcomes[f"RegisterEngine racing its session's end {code.name if code else 'OK'}"] += 1
            assert code in (None, grpc.StatusCode.NOT_FOUND), f"racing its session's end: {code}"
        if reply is not None:
            assert request.session_id == "" or session is not None, (
                f"{where} registered an engine under {request.session_id!r}, which is no session open there:"
                f"\n{request!r:.3000}")
            assert reply.engine.session_id == request.session_id, reply.engine.session_id
            self.engines[(where, request.engine_id)] = request.session_id
            if session is not None:
                session.engines.add(request.engine_id)
            if not unmutated:
                self.mutated_ok.add(where)
        elif unmutated and where not in self.mutated_ok and racing is None:
            if request.session_id and session is None:
                assert code is grpc.StatusCode.NOT_FOUND, f"under an unknown session: {code}, not NOT_FOUND"
            else:
                pytest.fail(f"{where} refused a valid registration ({code.name}) under session "
                            f"{request.session_id!r}:\n{request!r:.3000}")
        return reply is not None

    def unregister(self, where: str, engine_id: str) -> None:
        reply, code = self.f.call(self.f.local[where].UnregisterEngine,
                                  bpb.UnregisterEngineRequest(engine_id=engine_id), "UnregisterEngine")
        assert reply is not None, f"{where} could not unregister {engine_id!r}, which it holds: {code}"
        session = self.session_on(where, self.engines.pop((where, engine_id)))
        if session is not None:
            session.engines.discard(engine_id)

    def grant(self, session: HeldSession, step: EngineStep) -> None:
        """A grant on a held engine, watched; with `step.send`, the source engine writes into it."""
        f, w, where, engine_id = self.f, self.w, session.where, step.request.engine_id
        components = [c.component for c in step.request.components]
        grant = bpb.ExpectTransferRequest(request_id=f"sg-{next(w.numbers)}", engine_id=engine_id,
                                          components=components, dst_page_ids=step.grant_pages, expiry_ms=120_000)
        reply, _ = f.call(f.local[where].ExpectTransfer, grant, "ExpectTransfer")
        if reply is None:
            return
        call = f.local[where].WatchTransfer(bpb.WatchTransferRequest(engine_id=engine_id,
                                                                     request_id=grant.request_id),
                                            timeout=CALL_TIMEOUT_S + RELEASE_DEADLINE_S)
        written = step.send is not None and where == "decode"
        self.watched.append(Watched(session, engine_id, call, written))
        assert next(call).status.state == pb.TRANSFER_STATE_PENDING
        if written:
            self.send(bpb.TransferRequest(
                request_id=grant.request_id, engine_id=w.src.engine_id, peer_address=w.decode.peer_address,
                remote_engine_id=engine_id, components=components, src_page_ids=step.send[2]))

    def send_to_canary(self, step: EngineStep) -> None:
        """A prefill engine held by a session writes into the canary under a grant of the canary's."""
        w, (components, pages, src_pages) = self.w, step.send
        request_id = f"sc-{next(w.numbers)}"
        self.f.grant("decode", w.canary, request_id, components, pages)
        if request_id not in w.grants:
            return
        w.allow_write(components, pages)  # the session's end may fail the transfer after its write
        self.send(bpb.TransferRequest(
            request_id=request_id, engine_id=step.request.engine_id, peer_address=w.decode.peer_address,
            remote_engine_id=w.canary.engine_id, components=components, src_page_ids=src_pages))

    def send(self, request: bpb.TransferRequest) -> None:
        """Start a transfer on prefill and leave it in flight: the sessions may end under it."""
        self.transfers.append((self.f.local["prefill"].Transfer.future(request, timeout=CALL_TIMEOUT_S),
                               request, time.monotonic()))

    def settle_transfers(self) -> None:
        for future, request, started in self.transfers:
            try:
                future.result()
                code, details = None, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            self.f.check_alive("Transfer", request)
            self.f.outcomes[f"Transfer as sessions end {code.name if code else 'OK'}"] += 1
            if code is grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started >= CALL_TIMEOUT_S - 1:
                pytest.fail(f"Transfer hung for {CALL_TIMEOUT_S}s on\n{request!r:.3000}")
            assert code is None or code in DOCUMENTED, f"Transfer answered {code.name} ({details}) to\n{request}"
        self.transfers.clear()

    def end(self, session: HeldSession) -> None:
        """End the stream (a cancel, or the connection closing), maybe with a registration under it in
        flight, and wait until the broker has released what it held."""
        racing = None
        if self.data.draw(st.booleans()):
            request, _ = self.fresh_request(session.session_id, mutate=False)
            racing = self.f.local[session.where].RegisterEngine.future(request, timeout=CALL_TIMEOUT_S)
        if self.data.draw(st.sampled_from(["cancel", "close"])) == "cancel":
            session.call.cancel()
        session.channel.close()  # the session's own connection: this drops it
        self.open.remove(session)
        self.ended.append(session.session_id)
        if racing is not None:
            self.register(session.where, request, True, racing=session, issued=racing)
        self.wait_released(session)
        self.reached["engines released by their session's end"] += len(session.engines)
        for engine_id in session.engines:
            del self.engines[(session.where, engine_id)]
        self.f.check_alive("the end of a session", session)

    def wait_released(self, session: HeldSession) -> None:
        for watched in [x for x in self.watched if x.session is session]:
            try:
                last = [reply.status for reply in watched.call][-1]  # the stream ends at a terminal state
            except grpc.RpcError as exc:
                self.kept.append(f"the grant on {watched.engine_id!r}, held by session {session.session_id!r} that "
                                 f"ended, did not end within {CALL_TIMEOUT_S + RELEASE_DEADLINE_S}s: "
                                 f"{exc.code().name} {exc.details()}")
                pytest.fail(self.kept[0])
            self.f.outcomes[f"grant on a held engine {pb.TransferState.Name(last.state)}"] += 1
            if watched.written:
                assert last.state in TERMINAL, last
            else:
                assert (last.state == pb.TRANSFER_STATE_FAILED and last.code == grpc.StatusCode.ABORTED.value[0]
                        and "unregistered" in last.reason), f"the session's end left the grant {last}"
                self.reached["grants failed by their session's end"] += 1
            self.watched.remove(watched)
        deadline = time.monotonic() + RELEASE_DEADLINE_S
        while True:  # the release runs in the background: poll, within a deadline
            info = self.f.local[session.where].GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=CALL_TIMEOUT_S)
            left = session.engines & {e.engine_id for e in info.engines}
            listed = session.session_id in {s.session_id for s in info.sessions}
            if not left and not listed:
                return
            if time.monotonic() > deadline:
                self.kept.append(f"{RELEASE_DEADLINE_S}s after session {session.session_id!r} ended, "
                                 f"{session.where} still has {sorted(left)} registered"
                                 + (" and the session listed" if listed else ""))
                pytest.fail(self.kept[0])
            time.sleep(0.02)

    def check_listing(self) -> None:
        """GetBrokerInfo of both brokers agrees with the model: every engine of this example where it
        should be, under its session or none; every open session with its holder and engines."""
        w = self.w
        for where, own in (("prefill", w.src), ("decode", w.canary)):
            reply, _ = self.f.call(self.f.local[where].GetBrokerInfo, bpb.GetBrokerInfoRequest(), "GetBrokerInfo")
            listed = {e.engine_id: e.session_id for e in reply.engines}
            assert own.engine_id in listed, f"{where} lost {own.engine_id!r}, which no session held"
            expected = {engine_id: sid for (at, engine_id), sid in self.engines.items() if at == where}
            assert {i: listed.get(i) for i in expected} == expected, f"{where}: engines under sessions differ"
            sessions = {s.session_id: s for s in reply.sessions}
            for session in (s for s in self.open if s.where == where):
                info = sessions.get(session.session_id)
                assert info is not None, f"{where} does not list open session {session.session_id!r}"
                assert info.holder == session.holder, f"holder {info.holder!r} for {session.holder!r}"
                assert set(info.engine_ids) == session.engines, f"{where}: {info} holds not {session.engines}"
            assert not set(sessions) & set(self.ended), f"{where} still lists ended sessions"

    def close(self) -> None:
        """After a failure: end what is left, so that the next example (a shrink) starts clean."""
        for session in self.open:
            session.call.cancel()
            session.channel.close()
        for watched in self.watched:
            watched.call.cancel()
        for (where, engine_id), session_id in self.engines.items():
            if not session_id:
                with contextlib.suppress(grpc.RpcError):
                    self.f.local[where].UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=engine_id),
                                                         timeout=CALL_TIMEOUT_S)


async def test_fuzz_sessions(world):
    """Per example: open 0..3 sessions with drawn holders; register drawn, maybe mutated engines under
    drawn session ids (open there or on the other broker, ended, garbage, none); unregister some and
    register some ids again; grant on held engines and write into or out of them; end the sessions in
    a drawn order. Each end releases exactly that session's engines and fails their grants."""
    segment = SharedSegment.create(SESSION_SLOTS * SCRATCH_SLOT, "kvbt-fuzz-sessions")
    slots, ended, reached, kept = itertools.count(), [], Counter(), []

    @FUZZ
    @given(st.data())
    def run(fuzzer, data):
        example = SessionExample(fuzzer, data, segment, slots, ended, reached, kept)
        try:
            for _ in range(data.draw(st.integers(0, 3), label="sessions")):
                example.open_session(data.draw(st.sampled_from(BROKERS)), data.draw(HOLDERS))
            steps = []
            for _ in range(data.draw(st.integers(0, 5), label="engines")):
                step = example.draw_step()
                if example.register(step.where, step.request, step.unmutated):
                    steps.append(step)
            for step in steps:
                if step.fate != "keep":
                    example.unregister(step.where, step.request.engine_id)
                if step.fate == "again":  # the same id and memory, under another drawn session or none
                    again = bpb.RegisterEngineRequest()
                    again.CopyFrom(step.request)
                    again.session_id = step.again_session_id
                    example.register(step.where, again, step.unmutated)
            example.check_listing()
            for step in steps:  # the transfers stay in flight while the sessions end
                session = example.session_on(step.where, example.engines.get((step.where, step.request.engine_id)))
                if session is not None and step.grant_pages is not None:
                    example.grant(session, step)
                if session is not None and step.where == "prefill" and step.send is not None:
                    example.send_to_canary(step)
            for session in data.draw(st.permutations(example.open)):
                example.end(session)
                example.check_listing()
            example.settle_transfers()
            for (where, engine_id), session_id in list(example.engines.items()):
                assert session_id == "", f"{engine_id!r} is under {session_id!r}, which was never open"
                example.unregister(where, engine_id)
        finally:
            example.close()

    try:
        await run_fuzz(world, run)
    finally:
        segment.close()
        segment.unlink()
    print(dict(reached))
    if FUZZ.max_examples >= 50:  # fewer examples may not get this far; these are what the test is for
        assert reached["engines released by their session's end"], f"no session held an engine: {dict(reached)}"
        assert reached["grants failed by their session's end"], f"no session's end met a grant: {dict(reached)}"


# -- any bytes, to every method -------------------------------------------------------------------

METHODS = [("local", f"/kvbroker.v1.BrokerService/{m.name}", m.server_streaming)
           for m in bpb.DESCRIPTOR.services_by_name["BrokerService"].methods] + \
          [("peer", f"/kvbroker.v1.PeerService/{m.name}", m.server_streaming)
           for m in ppb.DESCRIPTOR.services_by_name["PeerService"].methods]


async def test_fuzz_raw_request_bytes_to_every_method(world):
    """Bytes that are not a valid message (truncated, corrupt varints, wrong wire types) are refused
    as INVALID_ARGUMENT; bytes that happen to parse take the ordinary paths."""

    @FUZZ
    @given(st.sampled_from(METHODS), st.sampled_from(["prefill", "decode"]),
           st.one_of(st.binary(max_size=512), st.sampled_from([b"\xff", b"\x0a\x05ab", b"\x08\xff\xff", b"\x0f"])))
    def run(fuzzer, method, where, raw):
        kind, path, streaming = method
        channel = fuzzer.channels[where if kind == "local" else f"{where}_peer"]
        if streaming:
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)(raw, timeout=10)
            try:
                next(call)
                code = None
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            finally:
                call.cancel()
            fuzzer.check_alive(path, raw)
            fuzzer.outcomes[f"raw {code.name if code else 'OK'}"] += 1
            assert code in DOCUMENTED | {None}, f"{path} answered {code} ({details}) to {raw!r}"
        else:
            fuzzer.call(channel.unary_unary(path, request_serializer=None, response_deserializer=None), raw,
                        f"raw {path}")

    await run_fuzz(world, run)


# -- PeerService -----------------------------------------------------------------------------------

async def test_fuzz_handshake(world):
    @FUZZ
    @given(st.data(), st.sampled_from(["prefill", "decode"]))
    def run(fuzzer, data, where):
        w = fuzzer.w
        engine = w.canary if where == "decode" else w.src
        seed = ppb.HandshakeRequest(broker_id="fuzzer", epoch=data.draw(U64), engine_id=engine.engine_id,
                                    backend=w.backend)
        request = mutated(data, seed, w.known, most=3)
        reply, _ = fuzzer.call(fuzzer.peer[where].Handshake, request, "Handshake")
        if reply is not None:
            assert reply.engine.engine_id == request.engine_id and reply.backend == w.backend

    await run_fuzz(world, run)


def claim_seed(data, fuzzer: Fuzzer) -> ppb.ClaimGrantRequest:
    w = fuzzer.w
    request_id = data.draw(st.sampled_from(["r-0", "r-1", "r-2", "fuzz-pending", f"c-{next(w.numbers)}"]))
    components, pages = data.draw(COMPONENTS), data.draw(PAGES)
    if data.draw(st.booleans()):
        fuzzer.grant("decode", w.canary, request_id, components, pages)
    claimed = data.draw(st.one_of(st.just([]), st.lists(st.sampled_from(pages), max_size=len(pages), unique=True)))
    return ppb.ClaimGrantRequest(broker_id="fuzzer", epoch=data.draw(U64), engine_id=w.canary.engine_id,
                                 request_id=request_id, components=components, dst_page_ids=claimed)


async def test_fuzz_claim_grant(world):
    @FUZZ
    @given(st.data())
    def run(fuzzer, data):
        w = fuzzer.w
        request = mutated(data, claim_seed(data, fuzzer), w.known, most=3)
        reply, _ = fuzzer.claim(request)
        if reply is not None and request.engine_id == w.canary.engine_id:
            granted_components, granted = w.grants[request.request_id]
            assert set(request.components) <= set(granted_components), f"claimed outside the grant: {request}"
            assert set(reply.dst_page_ids) <= set(granted), f"claim handed out pages outside the grant: {reply}"
            assert reply.claim_token

    await run_fuzz(world, run)


async def test_fuzz_complete_transfer(world):
    @FUZZ
    @given(st.data())
    def run(fuzzer, data):
        w = fuzzer.w
        seed = claim_seed(data, fuzzer)
        if data.draw(st.booleans()):
            fuzzer.claim(seed)
        key = (seed.engine_id, seed.request_id)
        token = data.draw(st.one_of(st.sampled_from([w.tokens.get(key, ""), ""]), ODD))
        request = ppb.CompleteTransferRequest(
            broker_id="fuzzer", engine_id=seed.engine_id, request_id=seed.request_id, claim_token=token,
            succeeded=data.draw(st.booleans()), code=data.draw(I32), reason=data.draw(ODD), pages=data.draw(U32),
            runs=data.draw(U32), bytes=data.draw(U64), truncated_pages=data.draw(U32))
        request = mutated(data, request, w.known, most=2)
        before = fuzzer.state("decode", request.engine_id, request.request_id)
        reply, _ = fuzzer.call(fuzzer.peer["decode"].CompleteTransfer, request, "CompleteTransfer")
        if reply is not None and before not in TERMINAL and before is not None and request.succeeded:
            claimed = w.tokens.get((request.engine_id, request.request_id))
            assert before == pb.TRANSFER_STATE_TRANSFERRING and request.claim_token == claimed, (
                f"a {pb.TransferState.Name(before)} grant was completed as written with a token ClaimGrant "
                f"did not hand out:\n{request}")

    await run_fuzz(world, run)


# -- a lying peer: the sender meets a PeerService that answers anything ------------------------------

class LyingPeer(ppb_grpc.PeerServiceServicer):
    """Answers each call with the reply (or the status) the current example drew."""

    def __init__(self) -> None:
        self.replies: dict[str, object] = {}

    def _answer(self, name: str, context):
        reply = self.replies[name]
        if isinstance(reply, grpc.StatusCode):
            context.abort(reply, f"lying peer says {reply.name}")
        return reply

    def Handshake(self, request, context):
        return self._answer("Handshake", context)

    def ClaimGrant(self, request, context):
        return self._answer("ClaimGrant", context)

    def CompleteTransfer(self, request, context):
        return self._answer("CompleteTransfer", context)


@pytest_asyncio.fixture(scope="module")
async def liar(world):
    """A lying PeerService, and the real handshake of a bystander broker's engine for it to replay:
    with the bystander's transfer-engine metadata and addresses, the sender's writes really happen."""
    bystander = await open_broker(f"fuzz-bystander-{world.backend}", world.backend, *BROKER_FLAGS)
    made = Engines()
    peer = LyingPeer()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    ppb_grpc.add_PeerServiceServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        engine = await made.make(bystander, "bystander", fill="canary")
        real = await real_handshake(bystander, engine.engine_id, world.backend, broker_id="fuzzer")
        world.bystanders.append(bystander)
        yield peer, f"127.0.0.1:{port}", real
    finally:
        server.stop(None)
        world.bystanders.clear()
        await made.close()
        code = await close_broker(bystander)
    assert code == 0, f"the bystander broker did not shut down cleanly: exit code {code}"


async def test_fuzz_transfer_against_a_lying_peer(world, liar):
    peer, address, real = liar
    error_codes = st.sampled_from(list(grpc.StatusCode)[1:])
    metadata = ppb.HandshakeResponse.DESCRIPTOR.fields_by_name["backend_metadata"]

    @FUZZ
    @given(st.data())
    def run(fuzzer, data):
        w = fuzzer.w
        remote = f"liar-{next(w.numbers)}"  # a fresh engine id: no cached handshake
        hello = ppb.HandshakeResponse()
        hello.CopyFrom(real)
        hello.engine.engine_id = remote
        if data.draw(st.booleans()):
            hello.backend_metadata = data.draw(scalar(metadata, w.known))
        shift = data.draw(st.sampled_from([0, 0, 1, -4096, 1 << 20, 1 << 40, None]))
        for component in hello.engine.components:  # point the writes elsewhere in (or out of) the peer
            for buffer in component.layer_buffers:
                buffer.address = data.draw(U64) if shift is None else max(0, buffer.address + shift) % 2**64
        components = data.draw(COMPONENTS)
        claim = ppb.ClaimGrantResponse(
            dst_page_ids=data.draw(PAGES), epoch=real.epoch, generation=real.generation, claim_token=data.draw(ODD),
            remaining_ms=data.draw(st.sampled_from([0, 50, 2000, 30_000])))
        peer.replies = {
            "Handshake": data.draw(st.one_of(st.just(mutated(data, hello, w.known, most=3)), error_codes)),
            "ClaimGrant": data.draw(st.one_of(st.just(mutated(data, claim, w.known, most=2)), error_codes)),
            "CompleteTransfer": data.draw(st.one_of(st.builds(ppb.CompleteTransferResponse, state=ENUM),
                                                    error_codes)),
        }
        request = bpb.TransferRequest(
            request_id=f"l-{next(w.numbers)}", engine_id=w.src.engine_id, peer_address=address,
            remote_engine_id=remote, components=components, src_page_ids=data.draw(PAGES))
        fuzzer.call(fuzzer.local["prefill"].Transfer, request,
                    f"Transfer against a lying peer {peer.replies!r:.3000}")

    await run_fuzz(world, run)
