"""The peer plane against peers that stall, flood or squat, on real brokers: a silent sender fails
each call that waits on it with its own status (never the calls beside it), and ExpectTransfer
answers only once its grant has ended, so the id can be tried again; offers are held to quotas per
peer identity and in total, the broker's memory bounded while real offers are still taken; a flood
of idle connections on the peer port leaves health and new transfers answering.

The misbehaving peers are the test's own: a gRPC server that accepts PeerService calls and never
answers them, raw PeerService clients, raw TCP connections."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import statistics
import time

import grpc
import numpy as np
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from kvbroker_tools.shapes import CANARY
from tests.support.brokers import assert_bytes, close_broker, close_brokers, open_broker
from tests.support.flows import MAIN, expect_pages, offer, part, refusal, watch_all
from tests.support.peer_side import Identity
from tests.support.watch import idle_connections

pytestmark = pytest.mark.integration


class SilentPeer:
    """A PeerService that takes every call and never answers it: counts the calls per method. With
    `streams`, it opens each NotifyStream, reads its messages (an offer counted as "offer on the
    stream") and answers none; without, it does not serve NotifyStream (UNIMPLEMENTED)."""

    def __init__(self, streams: bool) -> None:
        self.calls: dict[str, int] = {}
        self.streams = streams
        self._release = asyncio.Event()
        self.server = grpc.aio.server()
        self.address = ""

    def count(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1

    async def start(self) -> SilentPeer:
        peer = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                method = details.method.rsplit("/", 1)[-1]

                async def never(request, context):
                    peer.count(method)
                    await peer._release.wait()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "released")

                async def hold(requests, context):
                    await context.send_initial_metadata(())
                    async for request in requests:
                        peer.count("offer on the stream" if request.HasField("offer") else method)
                    await peer._release.wait()

                if method == "NotifyStream":
                    if not peer.streams:
                        return None
                    return grpc.stream_stream_rpc_method_handler(hold, ppb.NotifyStreamRequest.FromString)
                return grpc.unary_unary_rpc_method_handler(never)

        self.server.add_generic_rpc_handlers([Handler()])
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self._release.set()
        await self.server.stop(0)


@pytest.fixture(params=["stream", "unary"])
async def silent(request):
    """A silent sender broker: its offers go on its NotifyStream, or (a broker without it) as
    OfferGrant calls."""
    peer = await SilentPeer(streams=request.param == "stream").start()
    yield peer
    await peer.stop()


@pytest.fixture(scope="module")
async def quick_decode():
    """A decode broker whose peer calls time out after 1 s (the default is 5 s)."""
    broker = await open_broker("decode-quick", "nixl", "--peer-rpc-timeout-s", "1")
    yield broker
    await close_broker(broker)


def expect_from(dst, address: str, request_id: str, pages) -> bpb.ExpectTransferRequest:
    return bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id, expiry_ms=60_000,
                                     pages=[pb.ComponentPages(component=MAIN, page_ids=pages)],
                                     sender_address=address, sender_engine_id="prefill-silent/tp0")


async def test_a_silent_sender_fails_each_waiting_call_with_its_own_status(quick_decode, engines, silent):
    """50 ExpectTransfer to a sender that never answers their offers (on its NotifyStream, or as
    OfferGrant calls): each answers UNAVAILABLE within its own deadline (none hangs on another's
    timeout), only once its grant has ended (its watch opens on FAILED), and the same id may be tried
    again."""
    how = "offer on the stream" if silent.streams else "OfferGrant"
    dst = await engines.make(quick_decode, "decode", fill="canary")
    ids = [f"silent-{secrets.token_hex(4)}-{i}" for i in range(50)]
    calls = [dst.stub.ExpectTransfer(expect_from(dst, silent.address, rid, [i % 64]), timeout=60) for i, rid in
             enumerate(ids)]
    results = await asyncio.gather(*(refusal(call) for call in calls))
    codes = [r.code() for r in results]
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 50, codes
    assert all("offer to the sender broker" in r.details() for r in results)
    assert silent.calls.get(how) == 50, silent.calls
    for rid in ids[:5]:  # ended when the error came: nothing may write into its pages any more
        statuses = await watch_all(dst, rid, timeout=10)
        assert [s.state for s in statuses] == [pb.TRANSFER_STATE_FAILED]
    again = await refusal(dst.stub.ExpectTransfer(expect_from(dst, silent.address, ids[0], [0]), timeout=60))
    assert again.code() == grpc.StatusCode.UNAVAILABLE, again.details()  # tried again, not ALREADY_EXISTS
    assert silent.calls[how] == 51, silent.calls



# Both ends bound, under mutual TLS


class FakePeer(ppb_grpc.PeerServiceServicer):
    """A TLS PeerService of the test's own, holding a certificate of the brokers' CA: it answers
    Handshake and OfferGrant with what the test scripts (a replayed answer, a borrowed name). Its
    NotifyStream (`stream`): "offers" answers offers as OfferGrant does, "notices only" answers
    them as a broker that reads only notices there, "none" is not served (UNIMPLEMENTED)."""

    def __init__(self, identity: Identity, handshake: ppb.HandshakeResponse | None = None,
                 offer_answer: ppb.OfferGrantResponse | None = None, stream: str = "none") -> None:
        self.identity = identity
        self.handshake = handshake
        self.offer_answer = offer_answer
        self.stream = stream
        self.notices = 0
        self.offers = {"stream": 0, "OfferGrant": 0}
        self.server = grpc.aio.server()
        self.address = ""

    async def start(self) -> FakePeer:
        ppb_grpc.add_PeerServiceServicer_to_server(self, self.server)
        credentials = grpc.ssl_server_credentials(
            [(self.identity.paths["key"].read_bytes(), self.identity.paths["cert"].read_bytes())],
            root_certificates=self.identity.paths["ca"].read_bytes(), require_client_auth=True)
        port = self.server.add_secure_port("127.0.0.1:0", credentials)
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def Handshake(self, request, context):
        if self.handshake is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no engine")
        return self.handshake

    async def OfferGrant(self, request, context):
        self.offers["OfferGrant"] += 1
        return self.offer_answer

    async def NotifyStream(self, requests, context):
        if self.stream == "none":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        await context.send_initial_metadata(())
        async for request in requests:
            if request.HasField("offer"):
                self.offers["stream"] += 1
            if request.HasField("offer") and self.stream == "offers":
                yield ppb.NotifyStreamResponse(seq=request.seq, offer=self.offer_answer)
            else:
                self.notices += len(request.notices.notices)
                yield ppb.NotifyStreamResponse(seq=request.seq, acks=ppb.NotifyPartsResponse(acks=[
                    ppb.PartAck(state=pb.TRANSFER_STATE_TRANSFERRING) for _ in request.notices.notices]))

    async def NotifyParts(self, request, context):
        self.notices += len(request.notices)
        return ppb.NotifyPartsResponse(acks=[ppb.PartAck(state=pb.TRANSFER_STATE_TRANSFERRING)
                                             for _ in request.notices])


@pytest.fixture(scope="module")
async def bound(tmp_path_factory, backend):
    """Under one CA: a prefill broker admitting decode-*; the real decode broker and a squatting one
    (an admitted identity running kvbroker itself), each admitting prefill-*; certificates for the
    test's own fake peers."""
    directory = tmp_path_factory.mktemp("bound")
    ca = trustme.CA()
    ids = {name: Identity(ca, directory, name)
           for name in ("prefill-b", "decode-b", "decode-squat", "decode-fake", "prefill-fake")}
    prefill = await open_broker("prefill-b", backend, *ids["prefill-b"].flags, "--peer-allow", "decode-*")
    decode = await open_broker("decode-b", backend, *ids["decode-b"].flags, "--peer-allow", "prefill-*")
    squat = await open_broker("decode-squat", backend, *ids["decode-squat"].flags, "--peer-allow", "prefill-*")
    yield prefill, decode, squat, ids
    await close_brokers(prefill, decode, squat)


async def test_a_squatters_offer_neither_blocks_the_real_one_nor_gets_a_byte(bound, engines, request_id):
    """An admitted decode identity offers a request id before the real decode does: the real offer
    is taken all the same (its key differs), a part naming no receiver is refused while both could
    match, and the part naming the real receiver writes there alone; the squatter's grant fails."""
    prefill, decode, squat, _ = bound
    src = await engines.make(prefill, "prefill", seed=31)
    dst = await engines.make(decode, "decode", fill="canary")
    bait = await engines.make(squat, "decode", fill="canary")
    before = dst.segment.array.copy()
    await offer(bait, src, request_id, {MAIN: [3, 4]})
    await offer(dst, src, request_id, {MAIN: [5, 6]})  # not ALREADY_EXISTS
    ambiguous = await refusal(part(src, request_id, {MAIN: [0, 1]}))
    assert ambiguous.code() == grpc.StatusCode.FAILED_PRECONDITION and "receiver_broker_id" in ambiguous.details()
    done = await part(src, request_id, {MAIN: [0, 1]}, receiver="decode-b")
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [0, 1], [5, 6])]))
    assert int(np.count_nonzero(bait.segment.array != CANARY)) == 0
    assert (await watch_all(bait, request_id))[-1].state == pb.TRANSFER_STATE_FAILED


async def test_a_handshake_answer_that_replays_the_senders_own_metadata_is_refused(bound, engines, request_id,
                                                                                   backend):
    """An admitted decode identity offers a grant whose receiver is its own server, which answers the
    handshake with the prefill broker's own engine metadata and another prefill engine's layout:
    prefill refuses it and writes nothing into its own engine."""
    prefill, _, _, ids = bound
    src = await engines.make(prefill, "prefill", seed=32)
    other = await engines.make(prefill, "prefill", fill="canary")
    async with grpc.aio.secure_channel(prefill.peer_address, ids["decode-fake"].credentials) as channel:
        stub = ppb_grpc.PeerServiceStub(channel)
        own = await stub.Handshake(ppb.HandshakeRequest(broker_id="decode-fake", engine_id=other.engine_id,
                                                        backend=backend), timeout=10)
        replayed = ppb.HandshakeResponse()
        replayed.CopyFrom(own)
        replayed.broker_id = "decode-fake"
        fake = await FakePeer(ids["decode-fake"], handshake=replayed).start()
        try:
            await stub.OfferGrant(ppb.OfferGrantRequest(
                broker_id="decode-fake", epoch=own.epoch, peer_address=fake.address, engine_id=other.engine_id,
                request_id=request_id, sender_engine_id=src.engine_id,
                pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2])], remaining_ms=30_000,
                offer_token=secrets.token_hex(16), generation=own.generation), timeout=10)
            refused = await refusal(part(src, request_id, {MAIN: [0, 1]}, receiver="decode-fake"))
        finally:
            await fake.server.stop(0)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED and "own" in refused.details()
    assert int(np.count_nonzero(other.segment.array != CANARY)) == 0
    assert fake.notices <= 1  # at most the failure notice


async def test_a_handshake_answered_in_a_name_its_certificate_does_not_carry_is_refused(bound, engines, request_id,
                                                                                       backend):
    """decode-squat offers a grant whose receiver address is a server holding decode-fake's
    certificate, which answers the handshake as decode-squat with decode-squat's real answer: the
    sender dials it as decode-squat, TLS refuses the certificate, and nothing is written."""
    prefill, _, squat, ids = bound
    src = await engines.make(prefill, "prefill", seed=33)
    bait = await engines.make(squat, "decode", fill="canary")
    async with grpc.aio.secure_channel(squat.peer_address, ids["prefill-fake"].credentials) as channel:
        real = await ppb_grpc.PeerServiceStub(channel).Handshake(ppb.HandshakeRequest(
            broker_id="prefill-fake", engine_id=bait.engine_id, backend=backend), timeout=10)
    fake = await FakePeer(ids["decode-fake"], handshake=real).start()
    try:
        async with grpc.aio.secure_channel(prefill.peer_address, ids["decode-squat"].credentials) as channel:
            await ppb_grpc.PeerServiceStub(channel).OfferGrant(ppb.OfferGrantRequest(
                broker_id="decode-squat", epoch=real.epoch, peer_address=fake.address, engine_id=bait.engine_id,
                request_id=request_id, sender_engine_id=src.engine_id,
                pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2])], remaining_ms=30_000,
                offer_token=secrets.token_hex(16), generation=real.generation), timeout=10)
        refused = await refusal(part(src, request_id, {MAIN: [0, 1]}, receiver="decode-squat"))
    finally:
        await fake.server.stop(0)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
    assert int(np.count_nonzero(bait.segment.array != CANARY)) == 0


@pytest.mark.parametrize("stream", ["offers", "none"])
async def test_an_offer_answered_in_a_name_its_certificate_does_not_carry_fails(bound, engines, request_id, stream):
    """The decode broker offers to a server whose certificate names prefill-fake but which answers
    the offer (on its NotifyStream, or as an OfferGrant call) as the real prefill broker: the grant
    fails PERMISSION_DENIED, ended when it answers."""
    _, decode, _, ids = bound
    dst = await engines.make(decode, "decode", fill="canary")
    fake = await FakePeer(ids["prefill-fake"], offer_answer=ppb.OfferGrantResponse(broker_id="prefill-b", epoch=1),
                          stream=stream).start()
    try:
        refused = await refusal(dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=request_id, engine_id=dst.engine_id, expiry_ms=30_000,
            pages=[pb.ComponentPages(component=MAIN, page_ids=[1, 2])], sender_address=fake.address,
            sender_engine_id="prefill-b-0/tp0"), timeout=30))
    finally:
        await fake.server.stop(0)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
    assert "certificate does not name" in refused.details()
    assert [s.state for s in await watch_all(dst, request_id, timeout=10)] == [pb.TRANSFER_STATE_FAILED]
    assert fake.offers == ({"stream": 1, "OfferGrant": 0} if stream == "offers" else {"stream": 0, "OfferGrant": 1})


async def test_offers_to_a_broker_whose_stream_reads_notices_only_go_as_offer_grant_calls(bound, engines):
    """A sender broker of a version whose NotifyStream reads notices only answers the first offer
    there without an `offer`: it is sent again as an OfferGrant call and the grant goes live; the next
    offer to that broker goes straight as a call."""
    _, decode, _, ids = bound
    dst = await engines.make(decode, "decode", fill="canary")
    fake = await FakePeer(ids["prefill-fake"], offer_answer=ppb.OfferGrantResponse(broker_id="prefill-fake", epoch=7),
                          stream="notices only").start()
    try:
        for n, rid in enumerate([f"old-{secrets.token_hex(4)}", f"old-{secrets.token_hex(4)}"], start=1):
            status = await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
                request_id=rid, engine_id=dst.engine_id, expiry_ms=30_000,
                pages=[pb.ComponentPages(component=MAIN, page_ids=[n])], sender_address=fake.address,
                sender_engine_id="prefill-fake-0/tp0"), timeout=30)
            assert status.status.state == pb.TRANSFER_STATE_PENDING, status
            assert fake.offers == {"stream": 1, "OfferGrant": n}
            await dst.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=dst.engine_id, request_id=rid),
                                          timeout=30)
    finally:
        await fake.server.stop(0)


# Quotas before work


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


MILLION = 1 << 20
PAGES_PER_PEER = 2 * MILLION  # the flooded broker's max_offer_pages_per_peer: two offers of a million page ids


@pytest.fixture(scope="module")
async def quota(tmp_path_factory):
    """A prefill broker whose identities may each hold two offers of a million page ids, a real
    decode broker, and the certificate of an admitted identity that floods."""
    directory = tmp_path_factory.mktemp("quota")
    ca = trustme.CA()
    ids = {name: Identity(ca, directory, name) for name in ("prefill-q", "decode-q", "decode-flood")}
    prefill = await open_broker("prefill-q", "nixl", *ids["prefill-q"].flags, "--peer-allow", "decode-*",
                                "--max-offer-pages-per-peer", str(PAGES_PER_PEER))
    decode = await open_broker("decode-q", "nixl", *ids["decode-q"].flags, "--peer-allow", "prefill-*")
    yield prefill, decode, ids["decode-flood"]
    await close_brokers(prefill, decode)


def flood_offer(prefill, request_id: str) -> ppb.OfferGrantRequest:
    return ppb.OfferGrantRequest(
        broker_id="decode-flood", epoch=1, peer_address="127.0.0.1:9", engine_id="decode-x/tp0",
        request_id=request_id, pages=[pb.ComponentPages(component=MAIN, page_ids=range(MILLION))],
        remaining_ms=600_000, offer_token=secrets.token_hex(16), generation=1)


async def test_an_offer_flood_is_held_to_its_identitys_quota_and_real_offers_are_still_taken(quota, engines,
                                                                                            request_id):
    """An admitted identity sends 24 offers of a million page ids each (about 200 MB held, were they
    all kept): two are kept, the rest refused RESOURCE_EXHAUSTED naming the setting, the broker's
    memory grows by what two offers hold and the parsing of one at a time (measured against its own
    VmRSS before the flood), and the real decode's offer is taken and written meanwhile."""
    prefill, decode, flood = quota
    src = await engines.make(prefill, "prefill", seed=41)
    dst = await engines.make(decode, "decode", fill="canary")
    pid = prefill.process.process.pid
    baseline = rss_mib(pid)
    peak, codes, details = baseline, [], set()
    async with grpc.aio.secure_channel(prefill.peer_address, flood.credentials,
                                       options=[("grpc.max_send_message_length", 64 * MILLION)]) as channel:
        stub = ppb_grpc.PeerServiceStub(channel)
        for i in range(24):
            try:
                await stub.OfferGrant(flood_offer(prefill, f"{request_id}-flood-{i}"), timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                details.add(exc.details())
            peak = max(peak, rss_mib(pid))
    assert codes[:2] == [grpc.StatusCode.OK] * 2
    assert codes[2:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 22
    assert all("max_offer_pages_per_peer" in d for d in details), details
    kept = PAGES_PER_PEER * 8 / MILLION  # MiB of page arrays the two offers hold
    assert peak - baseline < kept + 64, (baseline, peak)  # all 24 kept would take ~200 MiB more
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: [8, 9]})
    done = await part(src, request_id, {MAIN: [0, 1]}, receiver="decode-q")
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [0, 1], [8, 9])]))


async def test_a_stranger_changing_its_name_on_every_offer_is_held_to_its_hosts_quota():
    """Without mutual TLS a broker_id is only a claim: offers from one host count against one quota,
    whatever names they carry, and the refusal names the host and the setting."""
    prefill = await open_broker("prefill-names", "nixl", "--max-offers-per-peer", "2")
    codes, details = [], set()
    try:
        async with grpc.aio.insecure_channel(prefill.peer_address) as channel:
            stub = ppb_grpc.PeerServiceStub(channel)
            for i in range(4):
                offer_grant = ppb.OfferGrantRequest(
                    broker_id=f"decode-liar-{i}", epoch=1, peer_address="127.0.0.1:9", engine_id="decode-x/tp0",
                    request_id=f"names-{i}", pages=[pb.ComponentPages(component=MAIN, page_ids=range(4))],
                    remaining_ms=60_000, offer_token=secrets.token_hex(16), generation=1)
                try:
                    await stub.OfferGrant(offer_grant, timeout=30)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
                    details.add(exc.details())
    finally:
        assert await close_broker(prefill) == 0
    assert codes == [grpc.StatusCode.OK] * 2 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert all("host ipv4:127.0.0.1" in d and "(max_offers_per_peer)" in d for d in details), details


# Health while the peer port is flooded


# deploy/base/deployment.yaml probes every 2 s: a health answer within a quarter of that keeps every
# probe in time on any machine. Without the bounds before work, a flooded broker answered health in
# seconds (5.95 s in issue 21's attack); with them, on this 2-core machine under two whole suites at
# once, 89 ms median against a calm 3 ms: ten times the calm median alone failed a healthy broker.
PROBE_SHARE_S = 0.5


def health_bound(before: list[float]) -> float:
    """What the median health time while flooded may be: ten times its calm median, the slowest calm
    check, or a quarter of the probes' period, whichever is largest."""
    return max(10 * statistics.median(before), max(before), PROBE_SHARE_S)


async def health_times(address: str, n: int = 30) -> list[float]:
    """How long each of `n` health checks took; each must answer SERVING."""
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(n):
            started = time.monotonic()
            reply = await stub.Check(health_pb2.HealthCheckRequest(service="kvbroker.v1.BrokerService"), timeout=30)
            out.append(time.monotonic() - started)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return out


async def test_health_on_the_local_api_answers_while_the_peer_port_is_flooded_with_idle_connections(
        brokers, engines, request_id):
    """3000 idle connections on the peer port (over max_peer_connections, 1024): the local API's health,
    which the probes ask (deploy/, kvbroker.ops.probe), answers SERVING each time, its median within
    `health_bound` of the checks before the flood, and a request of a peer already connected still moves."""
    if brokers.backend != "nixl":
        pytest.skip("one engine is enough: no engine is involved")
    src = await engines.make(brokers.prefill, "prefill", seed=42)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    await offer(dst, src, f"{request_id}-warm", {MAIN: [1]})  # the pair's connection is made before the flood
    await part(src, f"{request_id}-warm", {MAIN: [0]})
    before = await health_times(brokers.prefill.process.listen)
    with idle_connections(brokers.prefill.peer_address, 3000):
        during = await health_times(brokers.prefill.process.listen)
        await offer(dst, src, request_id, {MAIN: [5, 6]})
        done = await part(src, request_id, {MAIN: [2, 3]})
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert statistics.median(during) <= health_bound(before), (statistics.median(during), before)


HEALTH_CHILD = """
import json, sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
took = []
with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = health_pb2_grpc.HealthStub(channel)
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    for _ in range(int(sys.argv[2])):
        started = time.monotonic()
        reply = stub.Check(health_pb2.HealthCheckRequest(service="kvbroker.v1.BrokerService"), timeout=60)
        took.append(time.monotonic() - started)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.02)
print(json.dumps(took))
"""


async def health_in_child(address: str, n: int, busy=None) -> list[float]:
    """`n` health checks from a process of their own (the test's own loop, busy building big requests,
    must not be what is measured), while `busy()` runs here; how long each took."""
    import json
    import sys

    child = await asyncio.create_subprocess_exec(sys.executable, "-c", HEALTH_CHILD, address, str(n),
                                                 stdout=asyncio.subprocess.PIPE)
    try:
        assert (await asyncio.wait_for(child.stdout.readline(), 60)).strip() == b"ready"
        work = asyncio.ensure_future(busy()) if busy is not None else None
        out = await asyncio.wait_for(child.stdout.read(), 300)
        if work is not None:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_health_on_the_local_api_answers_while_the_peer_port_is_busy_with_big_requests(brokers):
    """16 callers keep sending OfferGrants of 3 page lists of a million ids each (about 9 MB, refused
    or kept up to the quotas) to the peer port: the local API's health, asked from another process,
    answers SERVING each time, its median within `health_bound` of its checks before."""
    if brokers.backend != "nixl":
        pytest.skip("one engine is enough: no engine is involved")
    broker = brokers.prefill
    ids = list(range(MILLION))
    request = ppb.OfferGrantRequest(
        broker_id="stranger", epoch=1, peer_address="127.0.0.1:9", engine_id="decode-x/tp0", request_id="x",
        pages=[pb.ComponentPages(component=MAIN, page_ids=ids) for _ in range(3)], remaining_ms=1000,
        offer_token=secrets.token_hex(16), generation=1)
    data = request.SerializeToString()  # built once: the test's loop sends bytes, it does not build them

    async def flood():
        async with grpc.aio.insecure_channel(broker.peer_address,
                                             options=[("grpc.max_send_message_length", 64 * MILLION)]) as channel:
            send = channel.unary_unary("/kvbroker.v1.PeerService/OfferGrant")

            async def caller():
                while True:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await send(data, timeout=30)

            await asyncio.gather(*(caller() for _ in range(16)))

    before = await health_in_child(broker.process.listen, 30)
    during = await health_in_child(broker.process.listen, 30, busy=flood)
    assert statistics.median(during) <= health_bound(before), (statistics.median(during), before)
