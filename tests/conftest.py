"""Fixtures the whole suite shares: real brokers in subprocesses on loopback, one pair per backend, and
engines on them; the session's non-PD SGLang server (`reference`, for tests/servers and the fleet in
tests/vllm) with the model and HTTP session the server tests share. What they are made of, and every
other helper the tests share, lives in tests/support (its __init__ maps it).

Run the suite through scripts/test.sh: it puts pytest (and so every broker) in a private network
namespace with only loopback, because UCX and Mooncake listen on all interfaces.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# Before tests.support is imported: its asserts report what they compared, as a conftest's do.
pytest.register_assert_rewrite("tests.support")

os.environ.setdefault("UCX_NET_DEVICES", "lo")
# Loopback has only UCX's tcp and shared memory, which a forged region writes through: allowed here
# (tests/integration/test_data_plane.py starts brokers without it).
os.environ.setdefault("KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS", "true")

import aiohttp  # noqa: E402
import pytest_asyncio  # noqa: E402

from kvbroker_tools.serving import models, stack  # noqa: E402
from tests.support.brokers import BACKENDS, BrokerPair, Engines, close_brokers, open_broker  # noqa: E402
from tests.support.reference import Reference  # noqa: E402


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest_asyncio.fixture(scope="session")
async def brokers(backend: str) -> AsyncIterator[BrokerPair]:
    prefill = await open_broker(f"prefill-{backend}", backend)
    decode = await open_broker(f"decode-{backend}", backend)
    yield BrokerPair(backend, prefill, decode)
    await close_brokers(prefill, decode)


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[Engines]:
    made = Engines()
    yield made
    await made.close()


_ids = iter(range(1, 1 << 30))


@pytest.fixture
def request_id() -> str:
    return f"req-{os.getpid()}-{next(_ids)}"


@pytest.fixture(scope="session")
def log_root(tmp_path_factory) -> Path:
    """The servers' logs, under pytest's base temp: the last three runs' are kept."""
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def model() -> Path:
    return models.llama()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def reference(model, log_root, http) -> AsyncIterator[Reference]:
    """The non-PD server, started once per run (not waited for: the first answer waits) and idle between."""
    server = await stack.start_server("reference", model, log_root / "reference", wait=False)
    async with Reference(server, http) as made:
        yield made
