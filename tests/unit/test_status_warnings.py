"""`kvbroker status` says what the peer port and the data ports are exposed to: a warning line under
plaintext, naming what a stranger can do (README, Security), none under mutual TLS; the data ports'
fence and protection. The same tables against a real broker: tests/integration/test_observability.py."""

from __future__ import annotations

from kvbroker.ops.status import UNAUTHENTICATED_WARNING, render


def status(*, authenticated: bool, data_port_range: str = "20100-20199", unprotected: str = "") -> dict:
    return {"address": "unix:/run/kvbroker/kvbroker.sock", "health": "SERVING", "broker_id": "b", "epoch": 1,
            "version": "0", "backend": "nixl", "peer_address": "10.0.0.7:50052",
            "peers_authenticated": authenticated, "peer_allow": ["prefill-*"], "data_port_range": data_port_range,
            "data_port_unprotected": unprotected, "engines": [], "peers": [], "sessions": [],
            "request_counts": {"PENDING": 0}}


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("WARNING")]


def test_plaintext_is_warned_about_with_what_a_stranger_can_do():
    text = render(status(authenticated=False))
    assert "peers         NOT authenticated, admitting prefill-*" in text
    (line,) = warnings(text)
    for what in ("squat", "confused deputy", "sniffed token", "complete or revoke"):
        assert what in line, (what, line)
    assert line.endswith(UNAUTHENTICATED_WARNING)


def test_mutual_tls_has_no_warning():
    text = render(status(authenticated=True))
    assert "peers         authenticated (mutual TLS), admitting prefill-*" in text
    assert not warnings(text)


def test_open_and_unprotected_data_ports_are_said():
    assert "data ports    20100-20199\n" in render(status(authenticated=True)) + "\n"
    text = render(status(authenticated=True, data_port_range="", unprotected="UCX_TLS is unset"))
    assert "data ports    OPEN TO ALL (data_port_range unset): fence them; UNPROTECTED: UCX_TLS is unset" in text
