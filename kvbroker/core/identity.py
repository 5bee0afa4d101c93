"""Who a peer broker is, as the domain acts on it: the edge (edge/trust.py, PeerGate) establishes
it from the call and its certificate; the flows compare it with what grants and offers name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerIdentity:
    name: str  # the broker id the broker acts on
    authenticated: bool  # True: a certificate the CA signed names it
    source: str = ""  # the host the call came from ("ipv4:10.0.0.7"); "" where not known

    @property
    def quota_key(self) -> str:
        """Whose share of the per-peer quotas (offers, calls) a call takes, as messages name it: a
        certified identity's own; without mutual TLS the name is only the caller's claim, so the host
        it calls from, and a stranger that changes names on every call stays one peer."""
        if self.authenticated or not self.source:
            return f"peer {self.name[:128]!r}"
        return f"host {self.source[:128]}"
