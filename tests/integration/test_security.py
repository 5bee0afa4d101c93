"""The peer port under mutual TLS: a peer the broker trusts writes; any other cannot handshake or write."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import trustme

from kvbroker_client.v1 import broker_service_pb2 as bpb
from tests.conftest import ALL, assert_bytes, close_broker, expected_after, open_broker
from tests.integration.flows import grant

pytestmark = pytest.mark.integration


def write_identity(ca: trustme.CA, directory, name: str) -> list[str]:
    """A certificate whose SANs name the broker (its broker id), as a peer's identity must."""
    cert = ca.issue_cert(name, "127.0.0.1", "localhost")
    paths = {kind: directory / f"{name}-{kind}.pem" for kind in ("cert", "key", "ca")}
    cert.private_key_pem.write_to_path(str(paths["key"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return ["--peer-tls-cert", str(paths["cert"]), "--peer-tls-key", str(paths["key"]),
            "--peer-tls-ca", str(paths["ca"])]


@pytest.fixture(scope="module")
async def tls_brokers(tmp_path_factory, backend):
    directory = tmp_path_factory.mktemp("tls")
    ca, stranger_ca = trustme.CA(), trustme.CA()
    decode = await open_broker("tls-decode", backend, *write_identity(ca, directory, "tls-decode"))
    trusted = await open_broker("tls-prefill", backend, *write_identity(ca, directory, "tls-prefill"))
    plaintext = await open_broker("plain-prefill", backend)
    stranger = await open_broker("stranger-prefill", backend,
                                 *write_identity(stranger_ca, directory, "stranger-prefill"))
    yield decode, trusted, plaintext, stranger
    for broker in (decode, trusted, plaintext, stranger):
        await close_broker(broker)


async def attempt(src, dst, request_id, ids):
    return await src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, peer_address=dst.broker.peer_address,
        remote_engine_id=dst.engine_id, components=ALL, src_page_ids=ids), timeout=30)


async def test_a_trusted_peer_transfers_over_mutual_tls(tls_brokers, engines, request_id):
    decode, trusted, _, _ = tls_brokers
    src = await engines.make(trusted, "prefill")
    dst = await engines.make(decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, [3, 4, 9])
    reply = await attempt(src, dst, request_id, [0, 1, 2])
    assert reply.status.pages == 3
    assert_bytes(dst, expected_after(src, dst, before, ALL, [0, 1, 2], [3, 4, 9]))


@pytest.mark.parametrize("who", ["plaintext", "stranger"])
async def test_an_untrusted_peer_cannot_handshake_or_write(tls_brokers, engines, request_id, who):
    decode, _, plaintext, stranger = tls_brokers
    src = await engines.make(plaintext if who == "plaintext" else stranger, "prefill")
    dst = await engines.make(decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, [3, 4, 9])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await attempt(src, dst, request_id, [0, 1, 2])
    assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE)
    assert np.array_equal(dst.segment.array, before)
    watch = dst.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id),
                                   timeout=10)
    first = await watch.read()
    watch.cancel()
    assert first.status.state == 1  # PENDING: the grant never saw the stranger
