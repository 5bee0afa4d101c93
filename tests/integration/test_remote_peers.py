"""A peer broker that restarts as the same broker id and pid, as a container does, is a new peer all
the same: the sender's transfer engine takes its new metadata.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvbroker.launch import start_broker
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from tests.conftest import ALL, Broker, assert_bytes, close_broker, expected_after, open_broker
from tests.integration.test_failures import free_port
from tests.integration.test_transfer import grant, transfer

pytestmark = pytest.mark.integration


def pid_inside(wrapper_pid: int) -> int:
    """The pid the wrapped broker sees for itself: the last NSpid of the wrapper's child."""
    children = Path(f"/proc/{wrapper_pid}/task/{wrapper_pid}/children").read_text().split()
    status = Path(f"/proc/{children[0]}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[-1])


async def test_a_peer_restarted_as_the_same_broker_id_and_pid_is_usable_again(backend, engines, request_id):
    """A container restart: the peer comes back as pid 1 with the pod's hostname, the same as before."""
    flags = ("--listen", f"127.0.0.1:{free_port()}", "--peer-listen", f"127.0.0.1:{free_port()}")
    in_container = ("unshare", "--pid", "--fork", "--kill-child", "--")  # unshare forwards no SIGTERM: kill it

    async def start_decode() -> Broker:
        process = await start_broker("decode-pid1", "--backend", backend, "--log-level", "WARNING", *flags,
                                     prefix=in_container)
        channel = grpc.aio.insecure_channel(process.listen)
        return Broker(process, channel, bpb_grpc.BrokerServiceStub(channel))

    prefill = await open_broker("prefill-pid1", backend)
    decode = await start_decode()
    try:
        assert pid_inside(decode.process.pid) == 1
        src = await engines.make(prefill, "prefill")
        dst = await engines.make(decode, "decode", fill="canary")
        await grant(dst, request_id, [0])
        await transfer(src, dst, request_id, [0])
        decode.process.kill()
        await close_broker(decode)

        decode = await start_decode()
        assert pid_inside(decode.process.pid) == 1
        again = await engines.make(decode, "decode", fill="canary")
        before = again.segment.array.copy()
        await grant(again, request_id + "-again", [4, 5])
        await transfer(src, again, request_id + "-again", [2, 3])
        assert_bytes(again, expected_after(src, again, before, ALL, [2, 3], [4, 5]))
    finally:
        for broker in (prefill, decode):
            broker.process.kill()
            await close_broker(broker)
