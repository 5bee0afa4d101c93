"""vLLM's own servers and router with kvbroker's connector, on both transfer engines: answers token for
token like the non-PD server, every prompt token moved (or held by decode's prefix cache), many at
once, and failures (a client gone, a broker restarted) leave both brokers holding nothing.

The servers are the session's (tests/vllm/conftest.py `vllm_pair`): the cases run on NIXL, then the
brokers restart on Mooncake and the cases run again. Decode's prefix cache outlives the switch, so each
engine's cases ask prompts of their own (`prompts_of`): a prompt decode already holds moves no page."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvbroker_tools.serving import client, stack, vllm_stack
from tests.support.helpers import until_awaited
from tests.support.vllm_servers import ANSWER_TOKENS, BLOCK, CONNECTOR, restart_broker, settled

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]  # servers start in minutes here
ENGINES = ["nixl", "mooncake"]


@pytest.fixture(scope="module", params=ENGINES)
def backend(request) -> str:
    """The brokers' transfer engine, this module's own: its cases run on one engine, then the other."""
    return request.param


def prompts_of(backend: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens that no case on another engine asked."""
    return client.prompts(count, length, seed=seed + 1_000_000 * ENGINES.index(backend))


async def sources(http, deployment) -> dict[str, float]:
    return await vllm_stack.prompt_token_sources(http, deployment.servers["decode"].url)


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in ("external_kv_transfer", "local_cache_hit",
                                                                    "local_compute")}


async def test_answers_match_the_non_pd_server_and_every_prompt_token_comes_by_transfer(vllm_pd, vllm_reference,
                                                                                      http, backend):
    prompts = [prompts_of(backend, 1, length, length)[0] for length in (20, BLOCK + 1, 2 * BLOCK, 97, 150, 300)]
    before = await sources(http, vllm_pd)
    for prompt in prompts:
        got = await vllm_stack.complete(http, vllm_pd.url, prompt, ANSWER_TOKENS)
        assert got.output_ids == await vllm_reference.answer(prompt), f"a prompt of {len(prompt)} tokens"
    assert moved(before, await sources(http, vllm_pd)) == {
        "external_kv_transfer": sum(len(p) for p in prompts), "local_cache_hit": 0, "local_compute": 0}
    await settled(vllm_pd, vllm_reference, http)


async def test_sixteen_requests_at_once_each_answer_as_the_non_pd_server(vllm_pd, vllm_reference, http, backend):
    prompts = [prompts_of(backend, 1, 40 + 11 * i, 100 + i)[0] for i in range(16)]
    answers = await asyncio.gather(*(vllm_stack.complete(http, vllm_pd.url, p, ANSWER_TOKENS) for p in prompts))
    for prompt, got in zip(prompts, answers):
        assert got.output_ids == await vllm_reference.answer(prompt), f"a prompt of {len(prompt)} tokens"
    await settled(vllm_pd, vllm_reference, http)


async def test_a_prefix_decode_holds_is_not_moved_again_and_the_rest_lands_after_it(vllm_pd, vllm_reference,
                                                                                    http, backend):
    """Decode caches the blocks it received; a prompt sharing three of them finds them there, and
    decode grants only the rest, naming the sender's first page it takes (src_offset 3)."""
    first = prompts_of(backend, 1, 3 * BLOCK + 10, 31)[0]
    second = first[:3 * BLOCK] + prompts_of(backend, 1, 45, 32)[0]
    for prompt in (first, second):
        before = await sources(http, vllm_pd)
        got = await vllm_stack.complete(http, vllm_pd.url, prompt, ANSWER_TOKENS)
        assert got.output_ids == await vllm_reference.answer(prompt)
        counts = moved(before, await sources(http, vllm_pd))
    assert counts == {"external_kv_transfer": len(second) - 3 * BLOCK, "local_cache_hit": 3 * BLOCK,
                      "local_compute": 0}
    await settled(vllm_pd, vllm_reference, http)


async def first_token_then_drop(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> list[int]:
    """A client that reads the first streamed token of a long answer and closes its connection."""
    body = vllm_stack.completion_body(prompt, 200)
    async with http.post(url + "/v1/completions", json=body,
                         timeout=aiohttp.ClientTimeout(total=vllm_stack.REQUEST_TIMEOUT_S)) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]" and (ids := vllm_stack.chunk_token_ids(line[5:])):
                response.close()
                return ids
    raise AssertionError("the stream ended before its first token")


async def test_a_client_gone_after_its_first_token_leaves_nothing_held(vllm_pd, vllm_reference, http, backend):
    prompt = prompts_of(backend, 1, 70, 41)[0]
    ids = await first_token_then_drop(http, vllm_pd.url, prompt)
    assert ids[:1] == (await vllm_reference.answer(prompt, 1))
    await settled(vllm_pd, vllm_reference, http)


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url + "/v1/completions", json=body,
                         timeout=aiohttp.ClientTimeout(total=vllm_stack.REQUEST_TIMEOUT_S)) as response:
        return response.status, await response.json(content_type=None)


async def test_a_request_decode_never_takes_is_let_go_after_hold_s_and_a_late_decode_fails_cleanly(
        vllm_pd, vllm_reference, http, backend):
    """Prefill answered (as the router asks it) and holds the request's blocks for decode's offer, but the
    client went away before decode was asked: after hold_s prefill frees them. Decode asked later with
    those kv_transfer_params gets an error at once (the prefill broker refuses the late offer), and
    both servers keep serving."""
    prompt = prompts_of(backend, 1, 80, 42)[0]
    status, answer = await post(http, vllm_pd.servers["prefill"].url, {
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["kvbroker"]["blocks"] == -(-len(prompt) // BLOCK)

    async def prefill_free():
        return not any((await vllm_stack.held(http, vllm_pd.servers["prefill"].url)).values())

    assert not await prefill_free(), "prefill does not hold the request's blocks for decode"
    assert await until_awaited(prefill_free, timeout=CONNECTOR["hold_s"] + 60), "prefill still holds the blocks"
    status, late = await post(http, vllm_pd.servers["decode"].url, {
        "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": False,
        "kv_transfer_params": params})
    assert status >= 400 and "error" in late, late
    await settled(vllm_pd, vllm_reference, http)


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_a_broker_restarted_comes_back_and_the_next_request_answers(vllm_pd, vllm_reference, http, side,
                                                                         backend):
    broker = await restart_broker(vllm_pd, side, backend)

    async def registered():
        return (await stack.broker_holds(broker))["engines"] == 1

    assert await until_awaited(registered, timeout=120), f"the {side} server's engine did not come back to its broker"
    prompt = prompts_of(backend, 1, 60, 50)[0]
    got = await vllm_stack.complete(http, vllm_pd.url, prompt, ANSWER_TOKENS)
    assert got.output_ids == await vllm_reference.answer(prompt), f"after the {side} broker restarted"
    await settled(vllm_pd, vllm_reference, http)


async def test_decode_killed_mid_request_fails_its_requests_and_a_new_decode_answers_again(vllm_pd, vllm_reference,
                                                                                          http, model, backend):
    """Decode's server dies while it answers requests: they fail at the client (no answer cut short
    passes as whole), both brokers end what they held, prefill frees its blocks; a decode started
    again on the same port is in the router's rotation again and answers as the non-PD server."""
    decode = vllm_pd.servers["decode"]
    prompts = [prompts_of(backend, 1, 150, 60 + i)[0] for i in range(4)]
    answering = asyncio.Event()  # decode streams a first token: it holds the KV and generates
    asked = [asyncio.ensure_future(vllm_stack.complete(http, vllm_pd.url, p, 300, answering=answering))
             for p in prompts]
    waiting = asyncio.ensure_future(answering.wait())
    try:
        await asyncio.wait({waiting, *asked}, timeout=300, return_when=asyncio.FIRST_COMPLETED)
        assert answering.is_set(), f"no answer began: {[t.exception() for t in asked if t.done()]}"
        assert not all(t.done() for t in asked), "every answer ended before decode was killed"
        await decode.kill()
    finally:
        waiting.cancel()
        results = await asyncio.gather(*asked, return_exceptions=True)
    assert any(isinstance(r, Exception) for r in results), "no request was in flight when decode died"
    vllm_pd.servers["decode"] = await vllm_stack.start_server(
        "decode", model, decode.log_path.parent, kv_transfer_config=vllm_pd.connector.decode_config,
        env=vllm_pd.connector.decode_env, port=decode.port)
    # the router took the dead decode out of rotation; it is back once the router's health checks see it
    await vllm_pd.servers["router"].wait_ready("/readiness", 120)
    await settled(vllm_pd, vllm_reference, http)
