"""vLLM's own servers and router with kvbroker's connector, on both transfer engines: answers token for
token like the non-PD server, every prompt token moved (or held by decode's prefix cache), many at
once, and failures (a client gone, a broker restarted) leave both brokers holding nothing."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from kvbroker.tools.serving import client, stack, vllm_stack
from tests.vllm.conftest import ANSWER_TOKENS, BLOCK, restart_broker, settled, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]  # servers start in minutes here


async def sources(http, deployment) -> dict[str, float]:
    return await vllm_stack.prompt_token_sources(http, deployment.servers["decode"].url)


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in ("external_kv_transfer", "local_cache_hit",
                                                                    "local_compute")}


async def test_answers_match_the_non_pd_server_and_every_prompt_token_comes_by_transfer(vllm_pd, vllm_reference,
                                                                                      vllm_http):
    prompts = [client.prompts(1, length, seed=length)[0] for length in (20, BLOCK + 1, 2 * BLOCK, 97, 150, 300)]
    before = await sources(vllm_http, vllm_pd)
    for prompt in prompts:
        got = await vllm_stack.complete(vllm_http, vllm_pd.url, prompt, ANSWER_TOKENS)
        assert got.output_ids == await vllm_reference.answer(prompt), f"a prompt of {len(prompt)} tokens"
    assert moved(before, await sources(vllm_http, vllm_pd)) == {
        "external_kv_transfer": sum(len(p) for p in prompts), "local_cache_hit": 0, "local_compute": 0}
    await settled(vllm_pd, vllm_reference, vllm_http)


async def test_sixteen_requests_at_once_each_answer_as_the_non_pd_server(vllm_pd, vllm_reference, vllm_http):
    prompts = [client.prompts(1, 40 + 11 * i, seed=100 + i)[0] for i in range(16)]
    answers = await asyncio.gather(*(vllm_stack.complete(vllm_http, vllm_pd.url, p, ANSWER_TOKENS) for p in prompts))
    for prompt, got in zip(prompts, answers):
        assert got.output_ids == await vllm_reference.answer(prompt), f"a prompt of {len(prompt)} tokens"
    await settled(vllm_pd, vllm_reference, vllm_http)


async def test_a_prefix_decode_holds_is_not_moved_again_and_the_rest_lands_after_it(vllm_pd, vllm_reference,
                                                                                    vllm_http):
    """Decode caches the blocks it received; a prompt sharing three of them finds them there, and
    decode grants only the rest, naming the sender's first page it takes (src_offset 3)."""
    first = client.prompts(1, 3 * BLOCK + 10, seed=31)[0]
    second = first[:3 * BLOCK] + client.prompts(1, 45, seed=32)[0]
    for prompt in (first, second):
        before = await sources(vllm_http, vllm_pd)
        got = await vllm_stack.complete(vllm_http, vllm_pd.url, prompt, ANSWER_TOKENS)
        assert got.output_ids == await vllm_reference.answer(prompt)
        counts = moved(before, await sources(vllm_http, vllm_pd))
    assert counts == {"external_kv_transfer": len(second) - 3 * BLOCK, "local_cache_hit": 3 * BLOCK,
                      "local_compute": 0}
    await settled(vllm_pd, vllm_reference, vllm_http)


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


async def test_a_client_gone_after_its_first_token_leaves_nothing_held(vllm_pd, vllm_reference, vllm_http):
    prompt = client.prompts(1, 70, seed=41)[0]
    ids = await first_token_then_drop(vllm_http, vllm_pd.url, prompt)
    assert ids[:1] == (await vllm_reference.answer(prompt, 1))
    await settled(vllm_pd, vllm_reference, vllm_http)


async def test_a_client_gone_before_its_first_token_leaves_nothing_held(vllm_pd, vllm_reference, vllm_http):
    """The client goes while prefill holds the request (decode paused: nothing offered yet), so prefill
    holds its blocks for an offer that may never come; decode resumed, nothing stays behind."""
    prompt = client.prompts(1, 80, seed=42)[0]
    decode = vllm_pd.servers["decode"]
    stack.signal_all([decode], [], signal.SIGSTOP)
    try:
        request = asyncio.ensure_future(vllm_stack.complete(vllm_http, vllm_pd.url, prompt, ANSWER_TOKENS))

        async def prefill_held():  # prefill finished the request and holds its blocks for decode
            return (await stack.broker_holds(vllm_pd.brokers["prefill"]))["live_requests"] > 0

        assert await until(prefill_held, timeout=120), "prefill never took the request"
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
    finally:
        stack.signal_all([decode], [], signal.SIGCONT)
    await settled(vllm_pd, vllm_reference, vllm_http)


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_a_broker_restarted_comes_back_and_the_next_request_answers(vllm_pd, vllm_reference, vllm_http, side,
                                                                         backend):
    broker = await restart_broker(vllm_pd, side, backend)

    async def registered():
        return (await stack.broker_holds(broker))["engines"] == 1

    assert await until(registered, timeout=120), f"the {side} server's engine did not come back to its broker"
    prompt = client.prompts(1, 60, seed=50)[0]
    got = await vllm_stack.complete(vllm_http, vllm_pd.url, prompt, ANSWER_TOKENS)
    assert got.output_ids == await vllm_reference.answer(prompt), f"after the {side} broker restarted"
    await settled(vllm_pd, vllm_reference, vllm_http)
