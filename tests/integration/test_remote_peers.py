"""The transfer engine lets go of peers it no longer needs: a peer broker that restarted leaves the
sender holding its new self only, and a peer is never dropped under a write that is still running.
A peer that restarts as the same broker id and pid, as a container does, is a new peer all the same.
A peer no longer used (a replaced pod's old address) is forgotten after peer_idle_s; one in use is not.

What the engine holds is read from the broker's own INFO log lines (`remote_peer`, `remote_peers`),
which each backend writes when it connects a new peer and when it forgets one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbroker.backends import create_backend
from kvbroker.config import Settings
from kvbroker.core.model import Descriptors, Region
from kvbroker_client.shm import SharedSegment
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_tools.launch import exit_description, start_broker
from tests.support.brokers import (
    ALL,
    SMALL,
    Broker,
    assert_bytes,
    close_broker,
    expected_after,
    open_broker,
    run_engines_in_child,
)
from tests.support.flows import free_port, grant, log_entries, transfer
from tests.support.helpers import descriptor_rows, until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def peer_events(broker) -> list[dict]:
    """The broker's log lines about the peers its transfer engine holds, oldest first."""
    return [entry for entry in log_entries(broker) if "remote_peers" in entry]


def held(events: list[dict]) -> set[str]:
    peers: set[str] = set()
    for entry in events:
        (peers.discard if entry["msg"].endswith("forgotten") else peers.add)(entry["remote_peer"])
    return peers


async def until_held(broker, expected: int, timeout: float = 10.0) -> list[dict]:
    """The peer events once the last one says the engine holds `expected` peers (or the timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        events = peer_events(broker)
        if (events and events[-1]["remote_peers"] == expected) or loop.time() > deadline:
            return events
        await asyncio.sleep(0.05)


async def test_a_restarted_peer_leaves_the_sender_holding_only_its_new_self(backend, engines, request_id):
    flags = ("--listen", f"127.0.0.1:{free_port()}", "--peer-listen", f"127.0.0.1:{free_port()}")
    prefill = await open_broker("prefill-peers", backend, "--log-level", "INFO", "--log-format", "json")
    decode = await open_broker("decode-peers", backend, *flags)
    try:
        src = await engines.make(prefill, "prefill")
        for n, dst in enumerate([await engines.make(decode, "decode", fill="canary") for _ in range(2)]):
            await grant(dst, f"{request_id}-{n}", [n])  # two handshakes with one peer epoch
            await transfer(src, dst, f"{request_id}-{n}", [n])
        events = await until_held(prefill, 1)
        (old,) = held(events)
        assert [e["remote_peers"] for e in events] == [1], "two engines of one peer broker share one peer"

        assert await close_broker(decode) == 0
        decode = await open_broker("decode-peers", backend, *flags)
        again = await engines.make(decode, "decode", fill="canary")
        before = again.segment.array.copy()
        await grant(again, request_id + "-again", [7, 8, 9])
        await transfer(src, again, request_id + "-again", [1, 2, 3])
        assert_bytes(again, expected_after(src, again, before, ALL, [1, 2, 3], [7, 8, 9]))

        events = await until_held(prefill, 1)
        assert any(e["remote_peer"] == old and e["msg"].endswith("forgotten") for e in events), events
        assert events[-1]["remote_peers"] == 1 and len(held(events)) == 1 and old not in held(events), events
    finally:
        for broker in (prefill, decode):
            broker.process.kill()
            await close_broker(broker)


async def peer_addresses(broker) -> set[str]:
    """The peers GetBrokerInfo lists."""
    info = await broker.stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
    return {p.address for p in info.peers}


IDLE_S = 2.0


def connected(broker) -> list[str]:
    """The peers the broker's transfer engine connected, in order."""
    return [e["remote_peer"] for e in peer_events(broker) if e["msg"].endswith("connected")]


def forgotten(broker) -> list[str]:
    return [e["remote_peer"] for e in peer_events(broker) if e["msg"].endswith("forgotten")]


async def test_a_peer_no_longer_used_is_forgotten_and_one_in_use_is_not(backend, engines, request_id):
    """A replaced pod comes back at a new address: the sender never dials the old one again and, after
    peer_idle_s, holds nothing of it, while it keeps the peer it goes on using; that one goes too once
    unused, and is usable again after."""
    prefill = await open_broker("prefill-idle", backend, "--log-level", "INFO", "--log-format", "json",
                                "--peer-idle-s", str(IDLE_S))
    old = await open_broker("decode-old", backend)
    new = await open_broker("decode-new", backend)
    sent = iter(range(1 << 30))
    in_use = asyncio.Event()
    try:
        src = await engines.make(prefill, "prefill")
        dst_old = await engines.make(old, "decode", fill="canary")
        dst_new = await engines.make(new, "decode", fill="canary")

        async def use(dst) -> None:
            n = next(sent)
            await grant(dst, f"{request_id}-{n}", [n % SMALL.num_pages])
            await transfer(src, dst, f"{request_id}-{n}", [n % SMALL.num_pages])

        async def keep_using(dst) -> int:
            """Transfers to `dst`, ten per idle period, until told to stop; returns how many."""
            uses = 0
            while in_use.is_set():
                await use(dst)
                uses += 1
                await asyncio.sleep(IDLE_S / 10)
            return uses

        await use(dst_old)
        in_use.set()
        using = asyncio.create_task(keep_using(dst_new))
        assert await until(lambda: len(connected(prefill)) >= 2 or using.done(), 10), peer_events(prefill)
        old_peer, new_peer = connected(prefill)[:2]
        assert await close_broker(old) == 0  # the pod is replaced by `new`, at another address

        assert await until(lambda: old_peer in forgotten(prefill) or using.done(), 10 * IDLE_S), peer_events(prefill)
        assert await peer_addresses(prefill) == {new.peer_address}
        await until(lambda: using.done(), 3 * IDLE_S)  # three idle periods more of using the new peer
        assert not using.done(), using.exception()
        in_use.clear()
        assert await asyncio.wait_for(using, 10) >= 10
        assert new_peer not in forgotten(prefill) and held(peer_events(prefill)) == {new_peer}, peer_events(prefill)
        assert await peer_addresses(prefill) == {new.peer_address}

        assert await until(lambda: new_peer in forgotten(prefill), 10 * IDLE_S), "a peer no longer used stayed"
        assert held(peer_events(prefill)) == set()
        assert await peer_addresses(prefill) == set()
        before = dst_new.segment.array.copy()
        await grant(dst_new, request_id + "-again", [40, 41])
        await transfer(src, dst_new, request_id + "-again", [1, 2])
        assert_bytes(dst_new, expected_after(src, dst_new, before, ALL, [1, 2], [40, 41]))
        assert await peer_addresses(prefill) == {new.peer_address}
    finally:
        in_use.clear()
        for broker in (prefill, old, new):
            broker.process.kill()
            await close_broker(broker)


class _Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "remote_peers"):
            self.seen.append(("forgotten" if record.getMessage().endswith("forgotten") else "connected",
                              record.remote_peers))


# A receiving engine in a process of its own, so that it can be stopped: over TCP (UCX_TLS=tcp for
# NIXL; Mooncake's tcp protocol) a write larger than the socket buffers cannot finish while its
# receiver is stopped. It registers the shared-memory segment named in argv, prints its metadata
# and where it mapped the segment, and runs until its stdin closes.
RECEIVER = textwrap.dedent("""
    import asyncio, base64, json, os, sys
    from kvbroker.backends import create_backend
    from kvbroker.config import Settings
    from kvbroker.core.model import Region
    from kvbroker_client.shm import SharedSegment

    async def main(backend, name, size):
        settings = Settings(backend=backend, listen="127.0.0.1:0", peer_listen="127.0.0.1:0")
        receiver = create_backend(settings, f"receiver-{os.getpid()}")
        await receiver.start()
        segment = SharedSegment(name, size, create=False)
        await receiver.register([Region(segment.array.ctypes.data, size, 0, gpu=False)])
        metadata = base64.b64encode(await receiver.metadata()).decode()
        print(json.dumps([metadata, segment.array.ctypes.data]), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    os._exit(0)  # NIXL's UCX teardown may crash at interpreter exit
""")


async def disconnect_during_write(backend: str) -> dict:
    """Two connects of one peer, both given back, the second while a write to it runs and cannot
    finish (its receiver is stopped); then the write ends, and the peer is connected again."""
    os.environ["UCX_TLS"] = "tcp"  # UCX's shared-memory transports would write into a stopped receiver
    events = _Events()
    logging.getLogger("kvbroker.backends").addHandler(events)
    logging.getLogger("kvbroker.backends").setLevel(logging.INFO)
    sender = create_backend(Settings(backend=backend, listen="127.0.0.1:0", peer_listen="127.0.0.1:0"),
                            f"sender-{os.getpid()}")
    size, length = 64 << 20, 1 << 16
    src = np.random.default_rng(11).integers(0, 256, size, dtype=np.uint8)
    dst = SharedSegment.create(size, "kvbt-receiver")
    receiver = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "faulthandler", "-c", RECEIVER, backend, dst.name, str(size), cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def loaded(peer) -> bool | None:
        """Whether NIXL itself still has the remote agent; Mooncake keeps nothing to ask about."""
        if backend != "nixl":
            return None
        return await sender._call(sender._agent.check_remote_metadata, peer)

    seen: dict = {}
    try:
        async with asyncio.timeout(90):
            await sender.start()
            await sender.register([Region(src.ctypes.data, size, 0, gpu=False)])
            answer = await receiver.stdout.readline()
            assert answer, f"the receiver {exit_description(await receiver.wait())}"
            metadata, address = json.loads(answer)
            metadata = base64.b64decode(metadata)
            offsets = np.arange(size // length) * length
            rows = Descriptors(descriptor_rows(src.ctypes.data, offsets, length),
                               descriptor_rows(address, offsets, length))
            first, second = await sender.connect(metadata), await sender.connect(metadata)
            seen["same_handle"] = first == second
            await sender.write(second, Descriptors(rows.src[:1], rows.dst[:1]), timeout=30)  # the engines meet
            await sender.disconnect(first)
            seen["loaded_after_one_disconnect"] = await loaded(second)

            os.kill(receiver.pid, signal.SIGSTOP)  # from here on the write cannot finish
            entered = asyncio.Event()

            async def write() -> None:
                entered.set()  # its waiter runs once write() has taken its hold on the peer and yielded
                await sender.write(second, rows, timeout=60)

            writing = asyncio.create_task(write())
            await entered.wait()
            seen["writing_before_disconnect"] = sender.writing(second)
            await sender.disconnect(second)
            seen["events_while_writing"] = list(events.seen)
            seen["write_ran_on"] = not writing.done()
            os.kill(receiver.pid, signal.SIGCONT)
            await writing
            seen["moved"] = bool(np.array_equal(dst.array, src))
            seen["events_after_write"] = list(events.seen)
            seen["loaded_after_write"] = await loaded(second)
            dst.array[:] = 0
            third = await sender.connect(metadata)
            await sender.write(third, rows, timeout=60)
            seen["moved_again"] = bool(np.array_equal(dst.array, src))
            seen["events"] = list(events.seen)
    finally:
        if receiver.returncode is None:
            os.kill(receiver.pid, signal.SIGCONT)
        receiver.stdin.close()
        try:
            await asyncio.wait_for(receiver.wait(), 30)
        except TimeoutError:
            receiver.kill()
            await receiver.wait()
        async with asyncio.timeout(60):
            await sender.close()
        dst.close()
        dst.unlink()
    seen["receiver_ended"] = exit_description(receiver.returncode)
    return seen


async def test_a_peer_given_back_during_a_write_is_forgotten_only_when_the_write_ends(backend):
    seen = await run_engines_in_child("tests.integration.test_remote_peers", "disconnect_during_write", backend, 150)
    nixl = backend == "nixl"
    assert seen["same_handle"], "two connects with one peer's metadata gave different handles"
    assert seen["loaded_after_one_disconnect"] is (True if nixl else None)
    assert seen["writing_before_disconnect"], "the write did not hold the peer before the disconnect"
    assert seen["write_ran_on"], "the write to a stopped receiver ended before it was let go on"
    assert seen["events_while_writing"] == [["connected", 1]], "the peer went while a write to it ran"
    assert seen["moved"], "the write did not move every byte"
    assert seen["events_after_write"] == [["connected", 1], ["forgotten", 0]]
    assert seen["loaded_after_write"] is (False if nixl else None)
    assert seen["moved_again"], "a peer connected again after it was forgotten cannot be written to"
    assert seen["events"] == [["connected", 1], ["forgotten", 0], ["connected", 1]]
    assert seen["receiver_ended"] == "exited with code 0"


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
