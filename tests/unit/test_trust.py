"""PeerGate: a certificate's names bind the broker id under mutual TLS; peer_allow admits by pattern."""

from __future__ import annotations

import pytest

from kvbroker.core.errors import BrokerError, Code
from kvbroker.edge.trust import SAN_PROPERTY, PeerGate, PeerIdentity

CERT = {SAN_PROPERTY: [b"prefill-0", b"prefill-0.kvbroker.svc"], "transport_security_type": [b"ssl"]}


def test_under_mutual_tls_the_broker_id_must_be_a_name_of_the_certificate():
    gate = PeerGate(["*"], authenticated=True)
    assert gate.identify("prefill-0", CERT) == PeerIdentity("prefill-0", True)
    with pytest.raises(BrokerError) as info:
        gate.identify("decode-3", CERT)
    assert info.value.code is Code.PERMISSION_DENIED
    assert "'decode-3' is not a name of the peer's certificate" in info.value.reason
    assert "prefill-0.kvbroker.svc" in info.value.reason


def test_a_certificate_without_names_proves_no_broker_id():
    with pytest.raises(BrokerError):
        PeerGate(["*"], authenticated=True).identify("prefill-0", {})


def test_without_mutual_tls_the_broker_id_is_a_claim():
    assert PeerGate(["*"], authenticated=False).identify("anyone", None) == PeerIdentity("anyone", False)


@pytest.mark.parametrize("name, admitted", [("prefill-0", True), ("prefill-12", True), ("decode-0", False),
                                            ("xprefill-0", False)])
def test_peer_allow_admits_by_pattern(name, admitted):
    gate = PeerGate(["prefill-*", "router"], authenticated=True)
    assert gate.admits(PeerIdentity(name, True)) is admitted


def test_an_empty_allow_list_admits_everyone():
    assert PeerGate([], authenticated=False).admits(PeerIdentity("x", False))


def test_a_certified_identity_is_its_own_peer_and_a_claimed_one_is_the_host_calling():
    certified = PeerGate(["*"], authenticated=True).identify("prefill-0", CERT, "ipv4:10.0.0.7")
    claimed = PeerGate(["*"], authenticated=False).identify("prefill-0", None, "ipv4:10.0.0.7")
    assert certified.quota_key == "peer 'prefill-0'" and claimed.quota_key == "host ipv4:10.0.0.7"
