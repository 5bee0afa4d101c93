"""Who a peer broker is, as the domain acts on it: the edge (edge/trust.py, PeerGate) establishes
it from the call and its certificate; the flows compare it with what grants and offers name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerIdentity:
    name: str  # the broker id the broker acts on
    authenticated: bool  # True: a certificate the CA signed names it
