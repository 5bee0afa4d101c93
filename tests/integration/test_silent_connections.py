"""Silent connections on the peer port, on real brokers, in plaintext and under mutual TLS: a stranger
that opens TCP connections and never says a word (no HTTP/2 preface, no TLS ClientHello) holds a
slot of max_peer_connections for peer_handshake_timeout_s at most. Those beyond the bound are closed
as they are accepted, the others once the handshake timeout passes; then a peer that connects
afresh is served: its offer is taken and its request written.

Each socket's end is awaited as its EOF (or reset), with a timeout (EOF_WAIT_S) well below grpc
core's own handshake timeout (120 s): without peer_handshake_timeout_s in the peer port's options
(grpc.server_handshake_timeout_ms, grpc.http2.settings_timeout) the plaintext case fails, 32 of 128
still open after 60 s. Without them the mTLS case failed when run alone and passed once when run
after the plaintext case (not understood), so it is not a reliable check of the setting itself; it
pins that the bound holds under TLS as well."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import trustme

from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import assert_bytes, close_brokers, open_broker
from tests.support.flows import MAIN, expect_pages, offer, part
from tests.support.peer_side import Identity

pytestmark = pytest.mark.integration

BOUND = 32  # the flooded broker's max_peer_connections
SILENT = 4 * BOUND
HANDSHAKE_S = 2.0  # its peer_handshake_timeout_s
EOF_WAIT_S = 60.0  # how long a silent socket may wait for its end: grpc core's default handshake timeout is 120 s


def silent(address: str, count: int) -> list[socket.socket]:
    """`count` connected TCP sockets to `address` that never send a byte."""
    host, _, port = address.rpartition(":")
    held = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.setblocking(False)
        held.append(sock)
    return held


async def ended(sock: socket.socket, timeout: float) -> bool:
    """Whether the broker ended `sock` (EOF or reset) within `timeout`; what it sent before (its HTTP/2
    SETTINGS, in plaintext) is read and dropped."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while await loop.sock_recv(sock, 1 << 16):
                pass
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return True


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
async def test_silent_connections_hold_a_slot_only_for_the_handshake_timeout(tls, tmp_path, engines, request_id):
    flags: dict[str, list[str]] = {"silent-flooded": [], "silent-peer": []}  # each broker's id: its certificate's
    if tls:
        ca = trustme.CA()
        flags = {name: Identity(ca, tmp_path, name).flags for name in flags}
    flooded = await open_broker("silent-flooded", "nixl", "--max-peer-connections", str(BOUND),
                                "--peer-handshake-timeout-s", str(HANDSHAKE_S), "--peer-connection-idle-s", "600",
                                *flags["silent-flooded"])
    peer = await open_broker("silent-peer", "nixl", *flags["silent-peer"])
    held: list[socket.socket] = []
    try:
        src = await engines.make(flooded, "prefill", seed=45)
        dst = await engines.make(peer, "decode", fill="canary")
        started = time.monotonic()
        held = silent(flooded.peer_address, SILENT)
        results = await asyncio.gather(*(ended(s, EOF_WAIT_S) for s in held))
        took = time.monotonic() - started
        assert all(results), f"{results.count(False)} of {SILENT} silent connections still open after " \
                             f"{EOF_WAIT_S:g}s (peer_handshake_timeout_s={HANDSHAKE_S:g})"
        print(f"{SILENT} silent connections ({'mTLS' if tls else 'plaintext'}) all closed by the broker "
              f"{took:.1f}s after the first was opened")

        # the peer's first connection to the flooded broker: its offer is taken, its request written
        before = dst.segment.array.copy()
        await offer(dst, src, request_id, {MAIN: [5, 6]}, timeout=30)
        done = await part(src, request_id, {MAIN: [2, 3]}, timeout=30)
        assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED, done.status
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [2, 3], [5, 6])]))
    finally:
        for s in held:
            s.close()
        assert await close_brokers(flooded, peer) == [0, 0]
