"""Peer trust on real brokers and engines: a grant is written and completed only by the broker it
names (or that claimed it); under mutual TLS a peer is its certificate; peer_allow decides who may
talk at all and a refused peer learns nothing; counters count what the receiver granted.

The stranger is a raw PeerService client of the test's own, holding (under TLS) a certificate the
brokers' CA signed for a name of its choosing."""

from __future__ import annotations

import asyncio
import os
import secrets

import grpc
import numpy as np
import pytest
import trustme

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc
from kvbroker_tools.shapes import CANARY
from tests.support.brokers import ALL, assert_bytes, close_broker, expected_after, open_broker
from tests.support.flows import M3, MAIN, expect_pages, offer, part, refusal, watch_first
from tests.support.helpers import scrape
from tests.support.peer_side import Identity

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def trust(tmp_path_factory, backend):
    """A decode broker admitting prefill-* only, a prefill broker, under one CA; raw clients for
    mallory (not admitted), prefill-7 and prefill-8 (admitted, but no grant names them)."""
    directory = tmp_path_factory.mktemp("trust")
    ca = trustme.CA()
    ids = {name: Identity(ca, directory, name) for name in ("decode-t", "prefill-t", "mallory", "prefill-7",
                                                             "prefill-8")}
    decode = await open_broker("decode-t", backend, *ids["decode-t"].flags, "--peer-allow", "prefill-*",
                               "--metrics-listen", "127.0.0.1:0")
    prefill = await open_broker("prefill-t", backend, *ids["prefill-t"].flags, "--peer-allow", "decode-*")
    channels = {name: grpc.aio.secure_channel(decode.peer_address, ids[name].credentials)
                for name in ("mallory", "prefill-7", "prefill-8")}
    yield decode, prefill, {name: ppb_grpc.PeerServiceStub(ch) for name, ch in channels.items()}
    for channel in channels.values():
        await channel.close()
    for broker in (decode, prefill):
        await close_broker(broker)


def claim(request_id, dst, broker_id, **kw):
    return ppb.ClaimGrantRequest(broker_id=broker_id, engine_id=dst.engine_id, request_id=request_id,
                                 components=ALL, **kw)


def complete(request_id, dst, broker_id, token="", succeeded=True, **kw):
    return ppb.CompleteTransferRequest(broker_id=broker_id, engine_id=dst.engine_id, request_id=request_id,
                                       claim_token=token, succeeded=succeeded, **kw)


def notice(request_id, dst, broker_id, token=None):
    return ppb.NotifyPartsRequest(broker_id=broker_id, notices=[ppb.PartNotice(
        engine_id=dst.engine_id, request_id=request_id, offer_token=token or secrets.token_hex(16), part=0,
        parts_total=1, succeeded=True, landed=[ppb.PartLanded(component=MAIN, dst_offset=0, pages=2)])])


async def code_of(call) -> grpc.StatusCode:
    return (await refusal(call)).code()


async def test_strangers_cannot_claim_complete_fail_or_notify_an_offered_grant(trust, engines, request_id):
    decode, prefill, stranger = trust
    src = await engines.make(prefill, "prefill", components=M3, seed=21)
    dst = await engines.make(decode, "decode", components=M3, fill="canary")
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: [5, 6]})
    for name, peer in stranger.items():
        assert await code_of(peer.ClaimGrant(claim(request_id, dst, name), timeout=10)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(peer.CompleteTransfer(complete(request_id, dst, name), timeout=10)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(peer.CompleteTransfer(complete(request_id, dst, name, succeeded=False, code=10),
                                                   timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    mallory = await refusal(stranger["mallory"].NotifyParts(notice(request_id, dst, "mallory"), timeout=10))
    assert mallory.code() == grpc.StatusCode.PERMISSION_DENIED and "peer_allow" in mallory.details()
    guessed = await stranger["prefill-7"].NotifyParts(notice(request_id, dst, "prefill-7"), timeout=10)
    assert guessed.acks[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING  # untouched
    assert_bytes(dst, before)
    done = await part(src, request_id, {MAIN: [0, 1]})
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [0, 1], [5, 6])]))


async def test_a_spoofed_broker_id_is_refused(trust, engines, request_id):
    decode, _, stranger = trust
    dst = await engines.make(decode, "decode", fill="canary")
    await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id,
                                                            components=ALL, dst_page_ids=[1, 2]), timeout=10)
    spoof = await refusal(stranger["prefill-7"].ClaimGrant(claim(request_id, dst, "prefill-t"), timeout=10))
    assert spoof.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'prefill-t' is not a name of the peer's certificate" in spoof.details()
    assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING


async def test_a_certificate_naming_no_admitted_peer_cannot_hold_a_notice_stream(trust):
    """mallory's certificate is valid but peer_allow admits none of its names: its NotifyStream ends
    PERMISSION_DENIED as it opens, before any message, and holds none of the port's stream slots."""
    _, _, stranger = trust
    for _ in range(6):  # more than max_notice_streams_per_peer (4), were they held
        stream = stranger["mallory"].NotifyStream(timeout=10)
        assert await stream.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "peer_allow" in await stream.details()
    admitted = stranger["prefill-7"].NotifyStream(timeout=10)
    await admitted.write(ppb.NotifyStreamRequest(seq=1, notices=ppb.NotifyPartsRequest(broker_id="prefill-7")))
    assert (await admitted.read()).seq == 1
    await admitted.done_writing()
    assert await admitted.code() == grpc.StatusCode.OK


async def test_a_peer_that_is_not_admitted_learns_nothing_from_a_handshake(trust, engines, backend):
    decode, _, stranger = trust
    dst = await engines.make(decode, "decode", fill="canary")

    def handshake(name, engine_id):
        return stranger[name].Handshake(ppb.HandshakeRequest(broker_id=name, engine_id=engine_id, backend=backend),
                                        timeout=10)

    refused = await refusal(handshake("mallory", dst.engine_id))
    unknown = await refusal(handshake("prefill-7", "decode-nobody/tp0"))
    assert refused.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
    assert refused.details().replace(dst.engine_id, "X") == unknown.details().replace("decode-nobody/tp0", "X")
    admitted = await handshake("prefill-7", dst.engine_id)  # the same engine, to an admitted peer
    assert admitted.engine.engine_id == dst.engine_id and admitted.backend_metadata


async def test_only_the_claimant_completes_a_claimed_grant_and_counters_stay_within_it(trust, engines, request_id):
    decode, _, stranger = trust
    dst = await engines.make(decode, "decode", fill="canary")
    await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id,
                                                            components=ALL, dst_page_ids=[1, 2, 3]), timeout=10)
    assert await code_of(stranger["mallory"].ClaimGrant(claim(request_id, dst, "mallory"), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    claimed = await stranger["prefill-8"].ClaimGrant(claim(request_id, dst, "prefill-8"), timeout=10)
    other = await refusal(stranger["prefill-7"].CompleteTransfer(
        complete(request_id, dst, "prefill-7", claimed.claim_token), timeout=10))
    assert other.code() == grpc.StatusCode.PERMISSION_DENIED and "claimed by 'prefill-8'" in other.details()
    assert await code_of(stranger["prefill-7"].CompleteTransfer(
        complete(request_id, dst, "prefill-7", succeeded=False), timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
    lying = await stranger["prefill-8"].CompleteTransfer(complete(
        request_id, dst, "prefill-8", claimed.claim_token, pages=2**32 - 1, runs=2**32 - 1, bytes=2**40,
        truncated_pages=2**32 - 1), timeout=10)
    assert lying.state == pb.TRANSFER_STATE_SUCCEEDED
    status = await watch_first(dst, request_id)
    item = sum(p.item_len for p in dst.placements)  # one page over every layer buffer of both components
    assert status.pages == 3 and status.bytes == 3 * item and status.truncated_pages <= 1 << 20
    metrics = await scrape(decode.process.metrics_listen)
    assert metrics["kvbroker_transferred_pages_total"] < 1e6


async def test_broker_info_says_whether_peers_are_authenticated(trust, brokers):
    decode, _, _ = trust
    tls = await decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    plain = await brokers.decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    assert tls.peers_authenticated and list(tls.peer_allow) == ["prefill-*"]
    assert not plain.peers_authenticated and list(plain.peer_allow) == ["*"]


async def test_without_tls_a_stranger_still_cannot_fail_or_notify_a_grant(brokers, engines, request_id):
    """On a plaintext peer port, broker ids are claims: the grant's tokens are what keep a stranger
    from failing a pending grant (the old empty-token hole) or faking an offered grant's parts."""
    src = await engines.make(brokers.prefill, "prefill", seed=22)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id,
                                                            components=ALL, dst_page_ids=[7, 8]), timeout=10)
    async with grpc.aio.insecure_channel(dst.broker.peer_address) as channel:
        peer = ppb_grpc.PeerServiceStub(channel)
        assert await code_of(peer.CompleteTransfer(complete(request_id, dst, "anyone", succeeded=False, code=10),
                                                   timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
        offered_id = request_id + "-offered"
        dst_offered = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
        src_offered = await engines.make(brokers.prefill, "prefill", components=M3)
        await offer(dst_offered, src_offered, offered_id, {MAIN: [1, 2]})
        faked = await peer.NotifyParts(notice(offered_id, dst_offered, src_offered.broker.process.broker_id),
                                       timeout=10)
        assert faked.acks[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert (await watch_first(dst, request_id)).state == pb.TRANSFER_STATE_PENDING
    assert (await watch_first(dst_offered, offered_id)).state == pb.TRANSFER_STATE_PENDING
    reply = await src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, peer_address=dst.broker.peer_address,
        remote_engine_id=dst.engine_id, components=ALL, src_page_ids=[0, 1]), timeout=30)
    assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expected_after(src, dst, before, ALL, [0, 1], [7, 8]))
    assert int(np.count_nonzero(dst_offered.segment.array != CANARY)) == 0


def rotate(identity: Identity, ca: trustme.CA, directory) -> Identity:
    """Replace `identity`'s files, each atomically (as a Secret volume or cert-manager's csi-driver
    does), with a certificate of `ca`; the new identity, for raw clients."""
    fresh = Identity(ca, directory, identity.name)
    for kind, path in identity.paths.items():
        os.replace(fresh.paths[kind], path)
    return fresh


async def handshake_code(address: str, identity: Identity, backend: str) -> grpc.StatusCode:
    """What a new connection presenting `identity` gets from a Handshake naming no engine."""
    async with grpc.aio.secure_channel(address, identity.credentials) as channel:
        call = ppb_grpc.PeerServiceStub(channel).Handshake(
            ppb.HandshakeRequest(broker_id=identity.name, engine_id="nobody/tp0", backend=backend), timeout=5)
        return await code_of(call)


async def test_rotated_certificates_are_taken_without_a_restart(tmp_path, backend, engines, request_id):
    """Both brokers' files move to a new CA while they run: new connections, served and dialled,
    use the new pair, the old CA is no longer trusted, and a transfer runs across."""
    old_ca, new_ca = trustme.CA(), trustme.CA()
    ids = {name: Identity(old_ca, tmp_path, name) for name in ("decode-r", "prefill-r")}
    decode = await open_broker("decode-r", backend, *ids["decode-r"].flags, "--peer-allow", "prefill-r")
    prefill = await open_broker("prefill-r", backend, *ids["prefill-r"].flags, "--peer-allow", "decode-r")
    try:
        src = await engines.make(prefill, "prefill", components=M3, seed=23)
        dst = await engines.make(decode, "decode", components=M3, fill="canary")
        before = dst.segment.array.copy()
        await offer(dst, src, f"{request_id}-old", {MAIN: [5, 6]})
        assert (await part(src, f"{request_id}-old", {MAIN: [0, 1]})).status.state == pb.TRANSFER_STATE_SUCCEEDED

        (tmp_path / "new").mkdir()
        rotated = {name: rotate(identity, new_ca, tmp_path / "new") for name, identity in ids.items()}
        for _ in range(75):  # up to 15 s: the files settle (tls.SETTLE_S), then a new connection takes them
            code = await handshake_code(decode.peer_address, rotated["prefill-r"], backend)
            if code != grpc.StatusCode.UNAVAILABLE:
                break
            await asyncio.sleep(0.2)
        assert code == grpc.StatusCode.NOT_FOUND  # TLS passed with the new CA: the engine is what is missing
        assert await handshake_code(decode.peer_address, ids["prefill-r"], backend) == grpc.StatusCode.UNAVAILABLE

        await offer(dst, src, f"{request_id}-new", {MAIN: [7, 8]})
        done = await part(src, f"{request_id}-new", {MAIN: [2, 3]})
        assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [0, 1], [5, 6]), (MAIN, [2, 3], [7, 8])]))
    finally:
        await close_broker(prefill)
        await close_broker(decode)
