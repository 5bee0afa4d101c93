"""GPU memory on real brokers: what a broker without CUDA answers, and who owns a registered engine's memory."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from tests.support.brokers import SMALL

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(torch.cuda.is_available(), reason="pins the answers of a broker on a machine without CUDA"),
]


def gpu_request(engine_id: str, handle: bytes | None = None, **fields) -> bpb.RegisterEngineRequest:
    """The index component of SMALL; its buffers in one CUDA allocation named by `handle`, or unset."""
    placements = shapes.place_buffers(SMALL, ("MINIMAX_INDEX_K",))

    def memory(offset: int) -> pb.MemoryRef | None:
        if handle is None:
            return None
        return pb.MemoryRef(cuda_ipc=pb.CudaIpcRef(handle=handle, device=0, offset=offset, allocation_size=1 << 30))

    return bpb.RegisterEngineRequest(
        engine_id=engine_id, topology=shapes.topology(SMALL),
        components=[pb.ComponentSpec(
            component=pb.COMPONENT_MINIMAX_INDEX_K, layout=pb.LAYOUT_FLAT, num_pages=SMALL.num_pages,
            layer_buffers=[pb.LayerBuffer(layer_id=p.layer_id, role=p.role, memory=memory(p.offset),
                                          length=SMALL.num_pages * p.item_len, item_len=p.item_len)
                           for p in placements])],
        **fields)


async def engine_ids(broker) -> list[str]:
    info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    return [e.engine_id for e in info.engines]


async def test_a_cuda_ipc_reference_is_refused_by_a_broker_without_cuda(brokers):
    request = gpu_request("gpu-refused/tp0", handle=bytes(range(1, 65)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await brokers.prefill.stub.RegisterEngine(request, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "memory.cuda_ipc: this broker has no CUDA support; use shared_memory" in info.value.details()
    assert "gpu-refused/tp0" not in await engine_ids(brokers.prefill)


async def test_a_broker_owned_pool_is_refused_by_a_broker_without_cuda(brokers):
    request = gpu_request("pool-refused/tp0", memory_ownership=bpb.MEMORY_OWNERSHIP_BROKER)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await brokers.prefill.stub.RegisterEngine(request, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("memory_ownership: MEMORY_OWNERSHIP_BROKER: this broker has no CUDA")
    assert "pool-refused/tp0" not in await engine_ids(brokers.prefill)


async def test_an_engine_in_shared_memory_is_reported_as_server_owned(brokers, engines):
    engine = await engines.make(brokers.decode, "owned")
    info = await brokers.decode.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    mine, = (e for e in info.engines if e.engine_id == engine.engine_id)
    assert mine.memory_ownership == bpb.MEMORY_OWNERSHIP_SERVER
