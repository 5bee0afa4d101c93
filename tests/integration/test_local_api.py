"""The local API's exposure and its bounds: a Unix socket only its group may use, sizes capped."""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from tests.support.brokers import ALL, close_broker, open_broker

pytestmark = pytest.mark.integration


@pytest.fixture
async def bounded(backend, tmp_path):
    broker = await open_broker("bounded", backend, "--listen", f"unix:{tmp_path}/api/kvbroker.sock",
                               "--max-pages-per-request", "8", "--max-message-bytes", str(64 * 1024))
    yield broker, tmp_path / "api" / "kvbroker.sock"
    await close_broker(broker)


async def test_local_api_on_a_unix_socket_is_not_world_accessible(bounded, engines):
    broker, path = bounded
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IXOTH) == 0, oct(mode)
    info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    assert info.broker_id == "bounded"


async def test_page_lists_past_the_bound_are_resource_exhausted(bounded, engines, request_id):
    broker, _ = bounded
    from tests.support.brokers import SMALL

    small = SMALL.__class__(**{**SMALL.__dict__, "num_pages": 8})
    dst = await engines.make(broker, "decode", small, fill="canary")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await broker.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=request_id, engine_id=dst.engine_id, components=ALL, dst_page_ids=list(range(9))),
            timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 8" in info.value.details()


async def test_pools_past_the_bound_are_refused_at_registration(bounded, engines):
    broker, _ = bounded
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await engines.make(broker, "decode", fill="canary")  # 64 pages per buffer, bound is 8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_pages: must be in [1, 8]" in \
        info.value.details()


async def test_messages_past_the_bound_are_resource_exhausted(bounded, request_id):
    broker, _ = bounded
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await broker.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=request_id, engine_id="x" * 100_000, dst_page_ids=[1]), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
