"""Protected by default (README.md, Security): the shipped roles run a data plane through which a forged
region cannot write outside registered memory, judged by the broker's own start-up rule
(kvbroker/backends/transports.py); NIXL over plain TCP is an explicit component that says what it gives
up, and Mooncake over TCP a protected one. Each is rendered on top of each role, as a user's overlay
would take it, and validated against the Kubernetes schemas."""

from __future__ import annotations

import os

import pytest

from kvbroker.backends.transports import unprotected
from kvbroker.config import Settings
from tests.support.deploy import COMPONENTS, OVERLAYS, broker, literal_env, lowered, render_overlay, settings


def pod_settings(docs: list[dict]) -> Settings:
    """The broker's Settings from the pod's ConfigMap alone (this process's KVBROKER_* variables, which
    the suite sets for its own brokers, left out)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KVBROKER_")]:
            patch.delenv(name)
        return Settings(**lowered(settings(docs)))


def data_plane(docs: list[dict]) -> tuple[str, str, bool]:
    """The broker's backend, the UCX_TLS its container sets (None: unset), and whether it is told to
    allow unprotected transports, as the broker would read them."""
    chosen = pod_settings(docs)
    return chosen.backend, literal_env(broker(docs)).get("UCX_TLS"), chosen.allow_unprotected_transports


@pytest.mark.parametrize("role", OVERLAYS)
def test_the_shipped_roles_run_protected_transports_only(tmp_path, role):
    backend, ucx_tls, allowed = data_plane(render_overlay(tmp_path, role, None))
    assert (backend, allowed) == ("nixl", False)
    assert unprotected(backend, ucx_tls) == "", ucx_tls  # the broker would start, and no forged region writes


@pytest.mark.parametrize("role", OVERLAYS)
def test_nixl_over_tcp_is_an_explicit_component_that_says_what_it_gives_up(tmp_path, role):
    backend, ucx_tls, allowed = data_plane(render_overlay(tmp_path, role, "nixl-tcp"))
    assert (backend, ucx_tls, allowed) == ("nixl", None, True)
    assert unprotected(backend, ucx_tls)  # what the broker warns about at start-up
    said = (COMPONENTS / "nixl-tcp" / "kustomization.yaml").read_text()
    assert "UNPROTECTED" in said and "outside registered memory" in said and "NetworkPolicy" in said


@pytest.mark.parametrize("role", OVERLAYS)
def test_mooncake_over_tcp_is_a_protected_component(tmp_path, role):
    docs = render_overlay(tmp_path, role, "mooncake-tcp")
    backend, ucx_tls, allowed = data_plane(docs)
    assert (backend, allowed) == ("mooncake", False) and unprotected(backend, ucx_tls) == ""
    assert pod_settings(docs).mooncake_protocol == "tcp"


def test_every_data_plane_component_is_rendered_here():
    assert sorted(p.name for p in COMPONENTS.iterdir() if "tcp" in p.name) == ["mooncake-tcp", "nixl-tcp"]
