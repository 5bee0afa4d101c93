"""Fixtures of the deployment tests: each overlay's manifests and deploy/cert-manager's, rendered once
per session (the readers they use live in tests/support/deploy.py)."""

from __future__ import annotations

import pytest

from tests.support.deploy import OVERLAYS, REPO_ROOT, kustomize


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Each overlay's manifests, as `kubectl kustomize deploy/overlays/<role>` prints them."""
    return {role: kustomize(REPO_ROOT / "deploy" / "overlays" / role) for role in OVERLAYS}


@pytest.fixture(scope="session")
def cert_manager() -> list[dict]:
    """deploy/cert-manager as kustomize renders it: the namespace's peer CA (cert-manager objects)."""
    return kustomize(REPO_ROOT / "deploy" / "cert-manager")


@pytest.fixture(params=OVERLAYS)
def role(request) -> str:
    return request.param


@pytest.fixture
def docs(rendered, role) -> list[dict]:
    return rendered[role]
