"""The gRPC channels of the peer clients, one per peer address (under peer TLS, per address and the
identity the server's certificate must name: `ssl_target_name_override`), each with its PeerService stub.

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
                 track: Callable[[asyncio.Task], object]) -> None:
        self._options = list(options)
        self._credentials = credentials  # the current TLS credentials and their generation (tls.PeerTls)
        self.grace_s = grace_s
        self._track = track
        # per (peer address, the identity its certificate must name; "": the host dialled, or
        # peer_tls_server_name): the channel, its stub, the generation of the credentials it was made with
        self._channels: dict[tuple[str, str], tuple[grpc.aio.Channel, ppb_grpc.PeerServiceStub, int]] = {}
        self._names: dict[str, str] = {}  # the identity an address is dialled as, once a caller expects one
        self.proven: set[tuple[str, str]] = set()  # (address, identity) a TLS handshake dialled so proved

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    def dial_as(self, address: str, name: str) -> None:
        """Dial `address` as `name` from now on (the identity a caller expects there); "": no change."""
        if name:
            self._names[address] = name

    def dialled_as(self, address: str) -> str:
        return self._names.get(address, "")

    def stub(self, address: str, name: str | None = None) -> ppb_grpc.PeerServiceStub:
        """The address's channel's stub, dialled as `name` (default: as `dial_as` said; "": the host):
        under TLS, a server whose certificate does not name it is refused. Made, or remade after the
        TLS files changed, as needed."""
        name = self._names.get(address, "") if name is None else name
        key = (address, name if self._credentials is not None else "")
        entry = self._channels.get(key)
        if self._credentials is None:
            if entry is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
                entry = self._channels[key] = (channel, ppb_grpc.PeerServiceStub(channel), 0)
            return entry[1]
        generation, credentials = self._credentials()
        if entry is not None and entry[2] != generation:
            self._close(key, grace=self.grace_s)
            entry = None
        if entry is None:
            options = self._options
            if name:
                options = [o for o in options if o[0] != "grpc.ssl_target_name_override"]
                options.append(("grpc.ssl_target_name_override", name))
            channel = grpc.aio.secure_channel(address, credentials, options=options)
            entry = self._channels[key] = (channel, ppb_grpc.PeerServiceStub(channel), generation)
        return entry[1]

    def close(self, address: str, grace: float | None = None, *, forget: bool = False) -> None:
        """Close the address's channels; with `grace`, the calls on them first end by themselves;
        with `forget`, the identity it is dialled as and the ones proven there too."""
        for key in [k for k in self._channels if k[0] == address]:
            self._close(key, grace)
        if forget:
            self._names.pop(address, None)
            self.proven = {p for p in self.proven if p[0] != address}

    def _close(self, key: tuple[str, str], grace: float | None = None) -> None:
        entry = self._channels.pop(key, None)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(entry[0].close(grace))
            self._track(task)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def close_all(self) -> None:
        for key in list(self._channels):
            self._close(key)
