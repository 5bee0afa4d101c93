"""SGLang 0.5.23 PD deployments for the real-server tests (tests/servers), started as users start them
(tooling/src/kvbroker_tools/serving): `start_stack` (a PD deployment, a broker per server, on one
transfer engine), `switch_engine` (its brokers moved to another), the arguments its servers take, and
the cases the Llama and MiniMax modules share, each answered against the session's non-PD reference
(tests/support/reference.py).

Every case leaves both servers serving and both brokers holding nothing: `settled` checks that
after each case, so cases stay independent though the servers are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp

from kvbroker_tools.serving import client, stack
from tests.support.helpers import serving, until_awaited
from tests.support.reference import ANSWER_TOKENS, Reference

CHUNK_TOKENS = 64  # prefill's --chunked-prefill-size: a prompt of n tokens goes in ceil(n / 64) parts
# --log-requests: the prefill log names each request it received (the disconnect case waits for it).
PREFILL_ARGS = ("--chunked-prefill-size", str(CHUNK_TOKENS), "--log-requests", "--log-requests-level", "0")
# Decode's radix cache: a prompt that shares a prefix with an earlier one finds it on decode.
DECODE_ARGS = ("--disaggregation-decode-enable-radix-cache",)
# A request that lost its peer ends in seconds, not SGLang's default 300.
SERVER_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}


async def start_stack(model: Path, log_dir: Path, engine: str) -> stack.PDStack:
    return await stack.start_pd(model, log_dir, transfer="kvbroker", engine=engine, prefill_args=PREFILL_ARGS,
                                decode_args=DECODE_ARGS, env=SERVER_ENV)


async def switch_engine(pd: stack.PDStack, engine: str) -> None:
    """Both brokers restarted with transfer engine `engine` on the same addresses; back once each holds
    its server's engine again. The whole transfer is the brokers': one deployment serves a module's
    cases on each engine in turn, and the servers (minutes to start) start once."""
    if pd.engine == engine:
        return
    pd.engine = engine
    await asyncio.gather(*(pd.restart_broker(side) for side in ("prefill", "decode")))
    held = await serving(pd.brokers.values(), engine)
    assert all(got == (engine, 1) for got in held.values()), f"the brokers on {engine}: {held}"


async def brokers_idle(pd: stack.PDStack) -> dict[str, dict[str, int]]:
    return {side: await stack.broker_holds(broker) for side, broker in pd.brokers.items()}


async def settled(pd: stack.PDStack, reference: Reference, http: aiohttp.ClientSession,
                  prompt: list[int] | None = None) -> None:
    """After a case: both brokers hold no request (grant, offer or Transfer record) and keep their
    engines; a fresh request through the router still answers as the reference does."""
    async def idle():
        held = await brokers_idle(pd)
        return held if all(h["live_requests"] == 0 for h in held.values()) else None

    held = await until_awaited(idle, timeout=90)
    assert held, f"a broker still holds requests: {await brokers_idle(pd)}"
    assert all(h["engines"] == 1 for h in held.values()), f"an engine is missing: {held}"
    # The same prompt after every case: from the second on, decode's radix cache holds all of it, and
    # only the first token's aux row moves (kvbroker_sglang.aux_only).
    prompt = prompt or client.prompts(1, 40, seed=10_000)[0]
    answer = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)
    assert (why := await reference.mismatch(prompt, answer.output_ids)) is None, f"the settling request: {why}"
    assert pd.prefill.alive() and pd.decode.alive()


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with http.post(url, json=body) as response:
        assert response.status == 200, f"POST {url}: HTTP {response.status}: {await response.text()}"


def received(server: stack.ServerProcess) -> int:
    """Requests the server's log says it received (it runs with --log-requests), the router's health
    checks aside."""
    return sum(1 for line in server.log_path.read_text(errors="replace").splitlines()
               if "Receive: obj=GenerateReqInput(" in line and "HEALTH_CHECK" not in line)


async def disconnect_after_bootstrap(pd: stack.PDStack, reference: Reference, http: aiohttp.ClientSession,
                                     prompt: list[int]) -> None:
    """The first token came back (decode holds the KV; the transfer is done), then the client goes."""
    ids = await client.first_token_then_drop(http, pd.url, prompt, max_new_tokens=200)
    assert await reference.mismatch(prompt, ids[:1], tokens=1) is None
    await settled(pd, reference, http)


async def disconnect_before_bootstrap(pd: stack.PDStack, reference: Reference, http: aiohttp.ClientSession,
                                      prompt: list[int]) -> None:
    """Decode paused in place ingests requests but sends no metadata: prefill holds the request in its
    bootstrap queue, unbootstrapped, when the client goes; then decode resumes."""
    before = received(pd.prefill)
    await post(http, pd.decode.url + "/pause_generation", {"mode": "in_place"})
    try:
        request = asyncio.ensure_future(client.generate(http, pd.url, prompt, ANSWER_TOKENS))

        async def prefill_has_it():  # no event says so; --log-requests logs each request prefill took
            return received(pd.prefill) > before

        assert await until_awaited(prefill_has_it, timeout=60), "prefill never received the request"
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    finally:
        await post(http, pd.decode.url + "/continue_generation", {})
    await settled(pd, reference, http)


async def restart_broker_then_ask(pd: stack.PDStack, reference: Reference, http: aiohttp.ClientSession,
                                  side: str, prompt: list[int]) -> None:
    await pd.restart_broker(side)

    async def registered():
        return (await stack.broker_holds(pd.brokers[side]))["engines"] == 1

    # The server's client registers its engine again as soon as its broker is back, with no call of
    # its own: a prefill server idle between requests would otherwise be found by decode's offer
    # with no engine (NOT_FOUND), and the next request would fail.
    assert await until_awaited(registered, timeout=120), f"the {side} server's engine did not come back to its broker"
    answer = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)
    why = await reference.mismatch(prompt, answer.output_ids)
    assert why is None, f"after the {side} broker restarted: {why}"
    await settled(pd, reference, http)
