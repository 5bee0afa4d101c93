"""Who answered a peer call: `Vouch`, used by the peer clients (clients.py) on every Handshake and
OfferGrant answer.

- A broker never writes into its own engines through a peer handshake: an answer in our own
  broker id, or carrying our own transfer engine's metadata (`Backend.is_own`), is refused.
- Under peer TLS the broker that answers must be the identity of its certificate. grpc's Python
  client cannot read the server's certificate, but its TLS handshake refuses one that does not
  name the target (`ssl_target_name_override`, PeerChannels). So an address the caller expects an
  identity at (the offered flow: the identity that made the offer) is dialled as that identity,
  and its answers must give it; an answer to a call that named only an address gives a broker id
  that one call dialled as that name proves (any answer but a TLS failure), once per address and
  name. Without TLS an answer's broker id is the peer's claim, as ours is to it.
"""

from __future__ import annotations

import asyncio
import re

import grpc

from kvbroker.backends.base import Backend
from kvbroker.core.errors import BrokerError, Code
from kvbroker.peers.channels import PeerChannels
from kvbroker_client.v1 import peer_service_pb2 as ppb

TLS_FAILURE = re.compile(r"ssl|tls|handshake|certificate|verification check", re.IGNORECASE)


class Vouch:
    def __init__(self, broker_id: str, epoch: int, backend: Backend, channels: PeerChannels) -> None:
        self._broker_id = broker_id
        self._epoch = epoch
        self._backend = backend
        self._channels = channels

    def refuse_own(self, address: str, broker_id: str, metadata: bytes = b"") -> None:
        """PERMISSION_DENIED for an answer in our own name or with our own engine's metadata."""
        if broker_id == self._broker_id or (metadata and self._backend.is_own(metadata)):
            own = "broker id" if broker_id == self._broker_id else "transfer engine metadata"
            raise BrokerError(Code.PERMISSION_DENIED, f"peer broker {address}: answers with this broker's own {own}; "
                                                      "a broker never writes into its own engines through a peer "
                                                      "handshake")

    async def check(self, address: str, broker_id: str, timeout: float, metadata: bytes = b"") -> None:
        """An answer from `address` in `broker_id` (with the engine `metadata` of a Handshake): not
        ours (refuse_own), and from the identity expected or proven there (answered)."""
        self.refuse_own(address, broker_id, metadata)
        await self.answered(address, broker_id, timeout)

    async def answered(self, address: str, broker_id: str, timeout: float) -> None:
        """The broker at `address` answered as `broker_id`: the identity it is dialled as must be that
        one (PERMISSION_DENIED "answers as"); with none, a TLS handshake dialled as `broker_id` must
        prove it (PERMISSION_DENIED "its certificate does not name it")."""
        expected = self._channels.dialled_as(address)
        if expected:
            if broker_id != expected:
                raise BrokerError(Code.PERMISSION_DENIED, f"peer broker {address}: answers as {broker_id[:128]!r}, "
                                                          f"not {expected!r}")
            return
        if not self._channels.tls or (address, broker_id) in self._channels.proven:
            return
        probe = ppb.HandshakeRequest(broker_id=self._broker_id, epoch=self._epoch, engine_id="",
                                     backend=self._backend.name)
        try:
            await self._channels.stub(address, broker_id).Handshake(probe, timeout=max(timeout, 0.001),
                                                                    wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE and TLS_FAILURE.search(exc.details() or ""):
                raise BrokerError(Code.PERMISSION_DENIED,
                                  f"peer broker {address}: answers as {broker_id[:128]!r}, but its certificate does "
                                  f"not name it: {exc.details()}") from None
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BrokerError(Code.UNAVAILABLE, f"peer broker {address}: no answer dialled as "
                                                    f"{broker_id[:128]!r}: {exc.details()}") from None
        self._channels.proven.add((address, broker_id))


def closed_under(exc: asyncio.CancelledError, address: str, method: str) -> BaseException:
    """What a peer call cancelled under its caller reports: the cancellation itself when the caller's
    task is being cancelled, else UNAVAILABLE, since grpc cancels the calls of a channel that closes
    (another call's timeout, the idle policy): the peer's failure, never a cancelled servicer."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return exc
    return BrokerError(Code.UNAVAILABLE, f"peer broker {address}: {method}: its channel closed before the answer")
