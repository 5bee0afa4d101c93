"""Fixtures of the SGLang backend tests: SGLang 0.5.23 itself (its plugin loaded, its runtime context
published as a scheduler process publishes it), real brokers, and SGLang ranks on them.

torchvision's op schemas are declared before anything imports sglang (see cpu_torchvision).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from tests.support.cpu_torchvision import declare_torchvision_ops

declare_torchvision_ops()

from kvbroker_tools.launch import BrokerProcess, start_broker, start_brokers  # noqa: E402
from tests.support import sglang_ranks as ranks  # noqa: E402

os.environ.setdefault("UCX_NET_DEVICES", "lo")
# Loopback has only UCX's tcp and shared memory, which a forged region writes through: allowed here
# (tests/integration/test_data_plane.py starts brokers without it).
os.environ.setdefault("KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS", "true")


def broker_flags(backend: str = "nixl") -> tuple[str, ...]:
    return ("--backend", backend, "--log-level", "WARNING")


BROKER_FLAGS = broker_flags()


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


class Ranks:
    """Builds SGLang KV managers (and the prefill's bootstrap server) on brokers; closes them after the test."""

    def __init__(self, process: ranks.SGLangProcess) -> None:
        self.process = process
        self._closers: list = []

    def bootstrap_server(self):
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        server_class = get_kv_class(TransferBackend.KVBROKER, KVClassType.BOOTSTRAP_SERVER)
        server = server_class(host="127.0.0.1", port=self.process.bootstrap_port)
        self._closers.append(server.close)
        return server

    def manager(self, broker_listen: str, mode: str, rank: ranks.Rank, *, is_mla: bool = False, **env: str):
        """SGLang's `_init_kv_manager` last step: the backend's manager class on these KVArgs."""
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

        manager_class = get_kv_class(TransferBackend.KVBROKER, KVClassType.MANAGER)
        saved = {k: os.environ.get(k) for k in ("KVBROKER_ADDRESS", *env)}
        os.environ.update({"KVBROKER_ADDRESS": broker_listen, **env})
        try:
            manager = manager_class(rank.kv_args, DisaggregationMode(mode), None, is_mla)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._closers.append(manager.close)
        return manager

    def close(self) -> None:
        for close in reversed(self._closers):
            close()


@pytest_asyncio.fixture(loop_scope="session")
async def sglang_ranks(sglang_process) -> AsyncIterator[Ranks]:
    made = Ranks(sglang_process)
    yield made
    await asyncio.to_thread(made.close)
