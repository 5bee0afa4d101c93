"""Fixtures of the SGLang backend tests: SGLang 0.5.23 itself (its plugin loaded, its runtime context
published as a scheduler process publishes it), real brokers, and SGLang ranks on them (built by
tests/support/sglang_ranks.py).

torchvision's op schemas are declared before anything imports sglang (kvbroker_tools.serving.cpu_torchvision).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

declare_torchvision_ops()

from kvbroker_tools.launch import BrokerProcess, start_broker, start_brokers  # noqa: E402
from tests.support import sglang_ranks as ranks  # noqa: E402
from tests.support.sglang_ranks import BROKER_FLAGS, Ranks, broker_flags  # noqa: E402


@pytest.fixture(scope="session")
def sglang_process() -> Iterator[ranks.SGLangProcess]:
    """SGLang with the kvbroker plugin loaded (SGLANG_PLUGINS=kvbroker) and a scheduler's context."""
    os.environ["SGLANG_PLUGINS"] = "kvbroker"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    with ranks.SGLangProcess(ranks.free_port()) as process:
        yield process


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def broker_pair() -> AsyncIterator[tuple[BrokerProcess, BrokerProcess]]:
    prefill, decode = await start_brokers(start_broker("sglang-prefill", *BROKER_FLAGS),
                                          start_broker("sglang-decode", *BROKER_FLAGS))
    yield prefill, decode
    await asyncio.gather(prefill.stop(), decode.stop())


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine_brokers(backend: str) -> AsyncIterator[tuple[BrokerProcess, BrokerProcess]]:
    """A prefill and a decode broker on each transfer engine (tests/conftest.py's `backend`)."""
    prefill, decode = await start_brokers(start_broker(f"sglang-prefill-{backend}", *broker_flags(backend)),
                                          start_broker(f"sglang-decode-{backend}", *broker_flags(backend)))
    yield prefill, decode
    await asyncio.gather(prefill.stop(), decode.stop())


@pytest_asyncio.fixture(loop_scope="session")
async def sglang_ranks(sglang_process) -> AsyncIterator[Ranks]:
    made = Ranks(sglang_process)
    yield made
    await asyncio.to_thread(made.close)
