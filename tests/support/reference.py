"""The session's non-PD SGLang server as the reference its PD deployments answer against (`Reference`),
and how many tokens an answer has (`ANSWER_TOKENS`). tests/conftest.py's `reference` fixture starts the
one server, once per run and idle between (--sleep-on-idle), for tests/servers and the fleet
(tests/vllm/test_fleet.py), with the `model` and `http` session they share."""

from __future__ import annotations

import asyncio

import aiohttp

from kvbroker_tools.serving import client, stack

ANSWER_TOKENS = 8


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

