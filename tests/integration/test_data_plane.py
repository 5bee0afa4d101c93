"""The data port, what kvbroker controls of it (README.md, Security; benchmarks/forged_region.py
measures what the engines do with a forged region): NIXL refuses to start on UCX transports that
write wherever a remote region points unless allow_unprotected_transports says so; a data port open
to all (data_port_range unset) is a WARNING at start-up and in `kvbroker status`; a sender refuses a
handshake whose layer buffers cannot hold their pages or lie outside the memory its NIXL metadata
registers, before anything is written."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools.launch import ChildDied
from tests.support.brokers import ALL, assert_bytes, close_broker, open_broker
from tests.support.helpers import kvbroker, peer_service
from tests.support.peer_side import Answers, real_handshake

pytestmark = pytest.mark.integration

STRICT = {"KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS": "false"}


@pytest.mark.parametrize("ucx_tls, named", [("", "UCX_TLS is unset"), ("tcp", "UCX_TLS=tcp names tcp"),
                                            ("rc,posix", "names posix"), ("ud", "names ud"), ("^rc", "UCX_TLS=^rc")])
async def test_nixl_refuses_to_start_on_unprotected_transports_unless_allowed(ucx_tls, named):
    with pytest.raises(ChildDied) as died:
        broker = await open_broker("strict-nixl", "nixl", env={**STRICT, "UCX_TLS": ucx_tls})
        await close_broker(broker)
    report = str(died.value)
    assert "startup failed" in report and named in report, report
    assert "allow_unprotected_transports" in report and "KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS" in report


async def test_mooncake_starts_without_the_setting():
    """Mooncake's tcp transport checks every address against its registered memory itself. (NIXL with
    UCX_TLS naming RDMA or GPU IPC transports only passes the check too, tests/unit/test_transports.py,
    but UCX cannot start on them without an RDMA device, which this machine has not.)"""
    backend, env = "mooncake", {}
    broker = await open_broker(f"strict-{backend}", backend, env={**STRICT, **env})
    try:
        code, out, err = await kvbroker("status", "--address", broker.process.listen)
        assert code == 0, err
        assert "UNPROTECTED" not in out
    finally:
        assert await close_broker(broker) == 0


async def test_a_data_port_open_to_all_is_a_warning_at_start_up_and_in_status():
    broker = await open_broker("open-data-port", "nixl", "--log-level", "WARNING")
    try:
        warned = "\n".join(broker.process.stderr_lines)
        assert "data_port_range is unset" in warned and "data port unprotected" in warned
        code, out, err = await kvbroker("status", "--address", broker.process.listen)
        assert code == 0, err
        assert "data ports    OPEN TO ALL (data_port_range unset)" in out
        assert "UNPROTECTED: UCX_TLS is unset" in out
    finally:
        assert await close_broker(broker) == 0
    fenced = await open_broker("fenced-data-port", "mooncake", "--data-port-range", "20100-20199")
    try:
        assert "data_port_range is unset" not in "\n".join(fenced.process.stderr_lines)
        code, out, err = await kvbroker("status", "--address", fenced.process.listen, "--json")
        assert code == 0, err
        assert '"data_port_range": "20100-20199"' in out and '"data_port_unprotected": ""' in out
    finally:
        assert await close_broker(fenced) == 0


def main_buffer(answer):
    component = next(c for c in answer.engine.components if c.component == pb.COMPONENT_MAIN_KV)
    return component, component.layer_buffers[0]


async def refused_by_liar(src, dst, lying, request_id) -> grpc.aio.AioRpcError:
    async with peer_service(Answers(lying)) as liar:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await src.stub.Transfer(bpb.TransferRequest(
                request_id=request_id, engine_id=src.engine_id, peer_address=liar, remote_engine_id=dst.engine_id,
                components=ALL, src_page_ids=list(range(8))), timeout=30)
    return refused.value


async def test_a_handshake_whose_layer_buffer_cannot_hold_its_pages_is_refused(brokers, engines, request_id):
    """The liar hands on decode's real answer with one layer buffer declared a page long: the pages
    past it would land in decode's next buffer. Refused before anything is written, both engines."""
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    lying = await real_handshake(brokers.decode, dst.engine_id, brokers.backend)
    _, buffer = main_buffer(lying)
    buffer.length = buffer.item_len
    refused = await refused_by_liar(src, dst, lying, request_id)
    assert refused.code() is grpc.StatusCode.ABORTED, refused.details()
    assert "unusable handshake" in refused.details() and "rule declared-buffer" in refused.details()
    assert_bytes(dst, before)


async def test_a_nixl_handshake_declaring_memory_its_metadata_does_not_register_is_refused(
        backend, brokers, engines, request_id):
    """The liar hands on decode's real answer with a layer buffer moved past decode's registered
    memory (into the unregistered tail of its segment): refused at the handshake, naming the buffer."""
    if backend != "nixl":
        pytest.skip("Mooncake's metadata names no memory; its receiving engine checks each address itself")
    src = await engines.make(brokers.prefill, "prefill")
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    before = dst.segment.array.copy()
    lying = await real_handshake(brokers.decode, dst.engine_id, backend)
    component, buffer = main_buffer(lying)
    last = max((b for c in lying.engine.components for b in c.layer_buffers), key=lambda b: b.address)
    buffer.address = last.address + last.length  # the segment's canary tail: registered by nobody
    buffer.length = component.num_pages * buffer.item_len
    refused = await refused_by_liar(src, dst, lying, request_id)
    assert refused.code() is grpc.StatusCode.ABORTED, refused.details()
    assert "registers no region holding its declared layer buffer" in refused.details()
    assert f"[{buffer.address:#x}, " in refused.details()
    assert_bytes(dst, before)
    assert np.array_equal(dst.segment.array, before)
