"""The peer port under mutual TLS: a peer the broker trusts writes; any other cannot handshake or write."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import trustme

from kvbroker_client.v1 import broker_service_pb2 as bpb
from tests.support.brokers import ALL, assert_bytes, close_broker, expected_after, open_broker
from tests.support.flows import grant, transfer
from tests.support.peer_side import Identity

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def tls_brokers(tmp_path_factory, backend):
    directory = tmp_path_factory.mktemp("tls")
    ca, stranger_ca = trustme.CA(), trustme.CA()
    decode = await open_broker("tls-decode", backend, *Identity(ca, directory, "tls-decode").flags)
    trusted = await open_broker("tls-prefill", backend, *Identity(ca, directory, "tls-prefill").flags)
    plaintext = await open_broker("plain-prefill", backend)
    stranger = await open_broker("stranger-prefill", backend,
                                 *Identity(stranger_ca, directory, "stranger-prefill").flags)
    yield decode, trusted, plaintext, stranger
    for broker in (decode, trusted, plaintext, stranger):
        await close_broker(broker)


async def test_a_trusted_peer_transfers_over_mutual_tls(tls_brokers, engines, request_id):
    decode, trusted, _, _ = tls_brokers
    src = await engines.make(trusted, "prefill")
    dst = await engines.make(decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    await grant(dst, request_id, [3, 4, 9])
    reply = await transfer(src, dst, request_id, [0, 1, 2], timeout=30)
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
        await transfer(src, dst, request_id, [0, 1, 2], timeout=30)
    assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE)
    assert np.array_equal(dst.segment.array, before)
    watch = dst.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id),
                                   timeout=10)
    first = await watch.read()
    watch.cancel()
    assert first.status.state == 1  # PENDING: the grant never saw the stranger
