"""Fixtures of the client tests: real brokers (a shared pair, and restartable ones), clients, pools,
made of tests/support/pools.py.

Everything runs on the session event loop (the broker processes' log readers live on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest
import pytest_asyncio

from kvbroker_client import BrokerClient
from kvbroker_tools.launch import start_broker, start_brokers
from tests.support.pools import BROKER_FLAGS, BrokerPair, Brokers, Pools, connect, release


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def client_brokers() -> AsyncIterator[BrokerPair]:
    prefill, decode = await start_brokers(start_broker("client-prefill", *BROKER_FLAGS),
                                          start_broker("client-decode", *BROKER_FLAGS))
    yield BrokerPair(prefill, decode)
    await asyncio.gather(prefill.stop(), decode.stop())


@pytest_asyncio.fixture(loop_scope="session")
async def prefill_client(client_brokers: BrokerPair) -> AsyncIterator[BrokerClient]:
    client = await connect(client_brokers.prefill.listen)
    yield client
    await release(client)


@pytest_asyncio.fixture(loop_scope="session")
async def decode_client(client_brokers: BrokerPair) -> AsyncIterator[BrokerClient]:
    client = await connect(client_brokers.decode.listen)
    yield client
    await release(client)


@pytest_asyncio.fixture(loop_scope="session")
async def brokers_of_test() -> AsyncIterator[Brokers]:
    made = Brokers()
    yield made
    await made.close()


@pytest.fixture
def pools() -> Iterable[Pools]:
    made = Pools()
    yield made
    made.close()
