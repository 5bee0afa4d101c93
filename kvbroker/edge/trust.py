"""Who a peer is, and whether it may talk to this broker. Called by the peer servicer on every call.

Under mutual TLS a peer is its certificate: the `broker_id` it sends must be one of the
certificate's subject alternative names, or the call is refused (PERMISSION_DENIED), so no
certificate of the CA can speak for another broker. Without mutual TLS a peer's `broker_id` is
its own claim: the broker says so at startup and in GetBrokerInfo (`peers_authenticated`).

`peer_allow` lists the identities (shell-style patterns, e.g. `prefill-*`) that may handshake,
offer, claim, complete or notify; "*" admits any. A peer that is not admitted learns nothing: its
Handshake gets the very answer an unknown engine gets.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.identity import PeerIdentity

__all__ = ["SAN_PROPERTY", "PeerCalls", "PeerGate", "PeerIdentity"]  # PeerIdentity lives in core: the flows take it

SAN_PROPERTY = "x509_subject_alternative_name"


class PeerGate:
    def __init__(self, allow: Sequence[str], *, authenticated: bool) -> None:
        self.allow = tuple(allow) or ("*",)
        self.authenticated = authenticated

    def identify(self, broker_id: str, auth_context: Mapping[str, Sequence[bytes]] | None,
                 source: str = "") -> PeerIdentity:
        """The caller's identity, calling from host `source`; under mutual TLS its broker_id must be a
        name of its certificate."""
        if not self.authenticated:
            return PeerIdentity(broker_id, False, source)
        names = sorted({n.decode(errors="replace") for n in (auth_context or {}).get(SAN_PROPERTY, ())})
        if broker_id not in names:
            shown = ", ".join(names[:8]) or "none"
            raise BrokerError(Code.PERMISSION_DENIED,
                              f"broker_id: {broker_id[:128]!r} is not a name of the peer's certificate (its subject "
                              f"alternative names: {shown})")
        return PeerIdentity(broker_id, True, source)

    def admits(self, identity: PeerIdentity) -> bool:
        return any(fnmatch.fnmatchcase(identity.name, pattern) for pattern in self.allow)

    def may_call(self, auth_context: Mapping[str, Sequence[bytes]] | None) -> bool:
        """Whether a connection could carry an admitted peer's calls: under mutual TLS, whether a name
        of its certificate is admitted; without it any caller may (its claim comes with each message)."""
        if not self.authenticated:
            return True
        names = {n.decode(errors="replace") for n in (auth_context or {}).get(SAN_PROPERTY, ())}
        return any(self.admits(PeerIdentity(name, True)) for name in names)


class PeerCalls:
    """Peer calls that wait being served at once, per peer and in total (max_peer_calls_per_peer,
    max_peer_calls): a call past either bound is refused RESOURCE_EXHAUSTED before any work, so
    that one peer's stalled or slow calls never take the others' room. A peer is a PeerIdentity's
    quota_key: a certified identity, or without mutual TLS the host calling, whatever names it claims."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self._held: dict[str, int] = {}
        self._all = 0

    def enter(self, peer: str) -> None:
        mine = self._held.get(peer, 0)
        if mine >= self.per_peer:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, f"broker_id: {peer} has {mine} calls being served, "
                                                       f"the limit (max_peer_calls_per_peer)")
        if self._all >= self.total:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, f"this broker has {self._all} peer calls being served, the "
                                                       "limit (max_peer_calls)")
        self._held[peer] = mine + 1
        self._all += 1

    def leave(self, peer: str) -> None:
        mine = self._held.get(peer, 0) - 1
        if mine > 0:
            self._held[peer] = mine
        else:
            self._held.pop(peer, None)
        self._all -= 1
