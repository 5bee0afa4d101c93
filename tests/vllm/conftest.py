"""Fixtures of the vLLM tests: vLLM 0.32's own servers (.venv-vllm, built by scripts/setup.sh --test),
started as users start them (tooling/src/kvbroker_tools/serving/vllm_stack.py): a non-PD reference server for the
session, and a prefill and a decode server with kvbroker's connector, a broker beside each, behind
vllm-router, started together in the background at first use (the fleet starts SGLang's servers
meanwhile) and shared by the modules, which move its brokers between the transfer engines. What the
tests share besides lives in tests/support/vllm_servers.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from kvbroker_tools.serving import vllm_stack
from tests.support.vllm_servers import Reference, Starting, switch_backend

os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.servers)


@pytest.fixture(scope="session")
def vllm_log_root(log_root) -> Path:
    """The vLLM servers' logs, beside the SGLang servers' (the model and HTTP session are theirs too:
    tests/conftest.py)."""
    return log_root / "vllm"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_starting(model, vllm_log_root) -> AsyncIterator[Starting]:
    """The session's vLLM servers, starting in the background from first use (`Starting`)."""
    (vllm_log_root / "pd").mkdir(parents=True, exist_ok=True)
    starting = await Starting.begin(model, vllm_log_root)
    yield starting
    await starting.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_reference(vllm_starting, http) -> Reference:
    return Reference(await vllm_starting.reference, http)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_pair(vllm_starting) -> vllm_stack.Deployment:
    """The session's PD pair with kvbroker's connector, its brokers on NIXL until a module moves them
    (`vllm_pd`; the fleet's own SGLang servers join them)."""
    return await vllm_starting.pair


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_pd(backend, vllm_pair) -> vllm_stack.Deployment:
    """The session's pair with its brokers on `backend`."""
    await switch_backend(vllm_pair, backend)
    return vllm_pair
