"""The session's non-PD SGLang server, the reference its PD deployments answer against, with the model
and HTTP session the server tests share. A plugin of the root conftest: tests/servers and the fleet
(tests/vllm/test_fleet.py) ask the one server, started once per run and idle between (--sleep-on-idle)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from kvbroker_tools.serving import client, models, stack

ANSWER_TOKENS = 8


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


class Reference:
    """The non-PD server and the answers it gave, by prompt; `async with` it to stop the server after."""

    def __init__(self, server: stack.ServerProcess, http: aiohttp.ClientSession) -> None:
        self.server = server
        self._http = http
        self._answers: dict[tuple[int, ...], client.Greedy] = {}
        # It starts beside the first PD deployment; the first answer waits for it.
        self.ready = asyncio.ensure_future(server.wait_ready("/health_generate", stack.START_TIMEOUT_S))

    async def mismatch(self, prompt: list[int], got: list[int], tokens: int = ANSWER_TOKENS) -> str | None:
        """Why `got` is not the reference's greedy answer to `prompt` (ties allowed), or None."""
        return await client.mismatch(self._greedy, prompt, got, tokens)

    async def _greedy(self, prompt: list[int], tokens: int) -> client.Greedy:
        await self.ready
        key = (*prompt, -tokens)
        if key not in self._answers:
            self._answers[key] = await client.greedy(self._http, self.server.url, prompt, tokens)
        return self._answers[key]

    async def __aenter__(self) -> Reference:
        return self

    async def __aexit__(self, *exc) -> None:
        self.ready.cancel()
        await self.server.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def reference(model, log_root, http) -> AsyncIterator[Reference]:
    server = await stack.start_server("reference", model, log_root / "reference", wait=False)
    async with Reference(server, http) as made:
        yield made
