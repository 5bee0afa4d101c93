"""A lying peer broker, played by a real gRPC PeerService in the test: what it answers never poisons the
sender's path to a real broker, and an answer beyond the sender's bounds is refused before anything is
built from it."""

from __future__ import annotations

import secrets
import time

import grpc
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from tests.support.brokers import ALL, assert_bytes, close_broker, expected_after, open_broker
from tests.support.helpers import peer_service, until
from tests.support.peer_side import Answers, real_handshake
from tests.support.watch import Watch, prompt_bound

pytestmark = pytest.mark.integration

MiB = 1 << 20


def lie(answer: ppb.HandshakeResponse, backend: str) -> ppb.HandshakeResponse:
    """The real broker's answer with its engine metadata cut short, as a lying peer sends it."""
    lying = ppb.HandshakeResponse()
    lying.CopyFrom(answer)
    metadata = answer.backend_metadata
    lying.backend_metadata = metadata[:len(metadata) * 3 // 4] if backend == "nixl" else metadata[:-1]
    return lying


@pytest.mark.parametrize("order", ["liar first", "real first"])
async def test_a_lying_peer_never_poisons_the_path_to_the_real_broker(brokers, engines, request_id, order):
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    answer = await real_handshake(brokers.decode, dst.engine_id, brokers.backend)

    async def to_liar(liar: str, n: int) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await src.stub.Transfer(bpb.TransferRequest(
                request_id=f"{request_id}-liar-{n}", engine_id=src.engine_id, peer_address=liar,
                remote_engine_id=dst.engine_id, components=ALL, src_page_ids=[0, 1]), timeout=30)
        assert failed.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNIMPLEMENTED), \
            failed.value.details()

    async def to_real(n: int, pages: list[int]) -> None:
        before = dst.segment.array.copy()
        await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=f"{request_id}-real-{n}", engine_id=dst.engine_id, components=ALL, dst_page_ids=pages),
            timeout=10)
        reply = await src.stub.Transfer(bpb.TransferRequest(
            request_id=f"{request_id}-real-{n}", engine_id=src.engine_id, peer_address=dst.broker.peer_address,
            remote_engine_id=dst.engine_id, components=ALL, src_page_ids=[5, 6]), timeout=30)
        assert reply.status.state == pb.TRANSFER_STATE_SUCCEEDED
        assert_bytes(dst, expected_after(src, dst, before, ALL, [5, 6], pages))

    servicer = Answers(lie(answer, brokers.backend))
    async with peer_service(servicer) as liar:
        if order == "liar first":
            await to_liar(liar, 0)
            await to_real(0, [3, 4])
        else:
            await to_real(0, [3, 4])
            await to_liar(liar, 0)
        await to_real(1, [8, 9])
        await to_liar(liar, 1)
        await to_real(2, [10, 11])
    assert servicer.handshakes >= 1


async def test_a_handshake_answer_with_more_layer_buffers_than_the_bound_is_refused_without_a_stall(
        backend, brokers, engines, request_id):
    prefill = await open_broker("bounds-answer", backend, "--log-level", "INFO")  # the request's end is logged
    try:
        await refuse_a_big_handshake_answer(prefill, brokers, engines, request_id)
    finally:
        assert await close_broker(prefill) == 0


async def refuse_a_big_handshake_answer(prefill, brokers, engines, request_id) -> None:
    src = await engines.make(prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    answer = await real_handshake(brokers.decode, dst.engine_id, brokers.backend)
    # The baseline, in the same run: a liar whose small answer is refused (its metadata cut short).
    async with peer_service(Answers(lie(answer, brokers.backend))) as small_liar:
        async with Watch(prefill.process.pid, [prefill.process.listen]).during() as calm:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError):
                await src.stub.Transfer(bpb.TransferRequest(
                    request_id=f"baseline-{secrets.token_hex(4)}", engine_id=src.engine_id, peer_address=small_liar,
                    remote_engine_id=dst.engine_id, components=[pb.COMPONENT_MAIN_KV], src_page_ids=[0, 1]),
                    timeout=30)
            calm_took = time.monotonic() - started
    took_bound, health_bound = prompt_bound([calm_took], floor=3.0), prompt_bound(calm.health_s)
    main = next(c for c in answer.engine.components if c.component == pb.COMPONENT_MAIN_KV)
    template = main.layer_buffers[0]
    main.ClearField("layer_buffers")
    main.layer_buffers.extend(ppb.PeerLayerBuffer(layer_id=i // 2, role=(pb.BUFFER_ROLE_K, pb.BUFFER_ROLE_V)[i % 2],
                                                  address=template.address, length=template.length,
                                                  item_len=template.item_len)
                              for i in range(400_000))
    answer.engine.topology.end_layer = 200_000
    assert answer.ByteSize() > 8 * MiB
    logged = len("\n".join(prefill.process.stderr_lines))
    async with peer_service(Answers(answer)) as liar:
        async with Watch(prefill.process.pid, [prefill.process.listen]).during() as watch:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await src.stub.Transfer(bpb.TransferRequest(
                    request_id=request_id, engine_id=src.engine_id, peer_address=liar,
                    remote_engine_id=dst.engine_id, components=[pb.COMPONENT_MAIN_KV], src_page_ids=[0, 1]),
                    timeout=30)
            took = time.monotonic() - started
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert "max_layer_buffers" in refused.value.details()
    assert took < took_bound, f"the refusal took {took:.1f}s (bound {took_bound:.1f}s)"
    slowest = max(watch.health_s)
    assert slowest < health_bound, f"health took up to {slowest:.1f}s (bound {health_bound:.1f}s)"
    lines = prefill.process.stderr_lines
    assert await until(lambda: any(request_id in line for line in lines), timeout=10), "no log line of its end"
    wrote = len("\n".join(lines)) - logged
    assert wrote < 16 << 10, f"the broker logged {wrote} bytes about one refused handshake"
