"""The gRPC channels of the peer clients, one per peer address, each with its PeerService stub.

Under peer TLS a channel made before the TLS files last changed is replaced (its calls under way
finish first), so that no reconnection presents a certificate that was rotated out. Closing a
channel runs as a task the owner tracks (`track`), so that its close can wait for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc


class PeerChannels:
    def __init__(self, options: Sequence[tuple[str, object]],
                 credentials: Callable[[], tuple[int, grpc.ChannelCredentials]] | None, grace_s: float,
                 track: Callable[[asyncio.Task], None]) -> None:
        self._options = list(options)
        self._credentials = credentials  # the current TLS credentials and their generation (tls.PeerTls)
        self._grace_s = grace_s
        self._track = track
        # per peer address: the channel, its stub, the generation of the credentials it was made with
        self._channels: dict[str, tuple[grpc.aio.Channel, ppb_grpc.PeerServiceStub, int]] = {}

    def stub(self, address: str) -> ppb_grpc.PeerServiceStub:
        """The address's channel's stub; made, or remade after the TLS files changed, as needed."""
        entry = self._channels.get(address)
        if self._credentials is None:
            if entry is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
                entry = self._channels[address] = (channel, ppb_grpc.PeerServiceStub(channel), 0)
            return entry[1]
        generation, credentials = self._credentials()
        if entry is not None and entry[2] != generation:
            self.close(address, grace=self._grace_s)
            entry = None
        if entry is None:
            channel = grpc.aio.secure_channel(address, credentials, options=self._options)
            entry = self._channels[address] = (channel, ppb_grpc.PeerServiceStub(channel), generation)
        return entry[1]

    def close(self, address: str, grace: float | None = None) -> None:
        entry = self._channels.pop(address, None)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(entry[0].close(grace))
            self._track(task)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def close_all(self) -> None:
        for address in list(self._channels):
            self.close(address)
