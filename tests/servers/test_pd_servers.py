"""SGLang 0.5.23 prefill and decode servers, SGLang's router and a kvbroker broker per server, on each
transfer engine of the brokers: every answer's greedy tokens equal the non-PD reference server's.

Each token after the first is computed by decode from the KV cache it received, so a page missing,
misplaced or stale changes the tokens. Prefill runs with --chunked-prefill-size 64: a prompt of n
tokens reaches decode in ceil(n / 64) parts. After every case both servers still serve and both
brokers hold nothing (tests/support/sglang_servers.py `settled`).

The servers start once for the module; the cases run on NIXL, then the brokers restart on Mooncake
(`switch_engine`) and the cases run again. Decode's radix cache outlives the switch, so each engine's
cases ask prompts of their own (`prompts_of`): a prompt decode already holds would move no page.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import pytest_asyncio

from kvbroker_tools.serving import client, stack
from tests.support.helpers import until_awaited
from tests.support.reference import ANSWER_TOKENS
from tests.support.sglang_servers import (
    CHUNK_TOKENS,
    brokers_idle,
    disconnect_after_bootstrap,
    disconnect_before_bootstrap,
    post,
    restart_broker_then_ask,
    settled,
    start_stack,
    switch_engine,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]  # a server start may take its 600 s bound

ENGINES = ["nixl", "mooncake"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def servers(model, log_root, reference):
    deployment = await start_stack(model, log_root / "pd", ENGINES[0])
    yield deployment
    await deployment.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=ENGINES)
async def pd(request, servers):
    await switch_engine(servers, request.param)
    return servers


def prompts_of(pd, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens that no case on another engine asked."""
    return client.prompts(count, length, seed=seed + 1_000_000 * ENGINES.index(pd.engine))


async def test_greedy_tokens_equal_the_reference_servers(pd, reference, http):
    for length in (5, 63, 64, 65, 200):
        prompt = prompts_of(pd, 1, length, length)[0]
        answer = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)
        why = await reference.mismatch(prompt, answer.output_ids)
        assert why is None, f"prompt of {length} tokens: {why}"
    await settled(pd, reference, http)


async def test_32_concurrent_requests(pd, reference, http):
    prompts = prompts_of(pd, 32, 90, 32)
    answers = await asyncio.gather(*(client.generate(http, pd.url, p, ANSWER_TOKENS) for p in prompts))
    wrong = {i: why for i, (a, p) in enumerate(zip(answers, prompts))
             if (why := await reference.mismatch(p, a.output_ids))}
    assert not wrong, f"requests answered other tokens than the reference: {wrong}"
    await settled(pd, reference, http)


async def test_long_prompt_in_many_parts(pd, reference, http):
    prompt = prompts_of(pd, 1, 40 * CHUNK_TOKENS + 17, 41)[0]  # 41 parts
    answer = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)
    assert (why := await reference.mismatch(prompt, answer.output_ids)) is None, why
    await settled(pd, reference, http)


async def test_request_whose_prefix_decode_holds(pd, reference, http):
    first = prompts_of(pd, 1, 3 * CHUNK_TOKENS, 7)[0]
    await client.generate(http, pd.url, first, ANSWER_TOKENS)
    longer = first + prompts_of(pd, 1, 50, 8)[0]
    answer = await client.generate(http, pd.url, longer, ANSWER_TOKENS)
    assert answer.meta.get("cached_tokens", 0) > 0, f"decode found no prefix: {answer.meta}"
    assert (why := await reference.mismatch(longer, answer.output_ids)) is None, why
    await settled(pd, reference, http)


async def test_request_whose_whole_prompt_decode_holds(pd, reference, http):
    """The same prompt twice: decode's radix cache holds every token of it the second time, so no page
    moves, only the first token (SGLang's zero-page last chunk)."""
    prompt = prompts_of(pd, 1, 2 * CHUNK_TOKENS + 3, 9)[0]
    answer = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)
    assert (why := await reference.mismatch(prompt, answer.output_ids)) is None, why
    before = await brokers_idle(pd)
    again = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)
    assert again.output_ids == answer.output_ids
    # no grant and no Transfer: neither broker counted a request for it
    assert await brokers_idle(pd) == before, "the second request moved pages: decode did not hold the whole prompt"
    await settled(pd, reference, http)


async def test_client_that_disconnects_after_bootstrap(pd, reference, http):
    await disconnect_after_bootstrap(pd, reference, http, prompts_of(pd, 1, 130, 51)[0])


async def test_client_that_disconnects_before_bootstrap(pd, reference, http):
    await disconnect_before_bootstrap(pd, reference, http, prompts_of(pd, 1, 130, 52)[0])


async def test_decode_broker_restarted_between_requests(pd, reference, http):
    await restart_broker_then_ask(pd, reference, http, "decode", prompts_of(pd, 1, 100, 72)[0])


async def test_decode_killed_mid_transfer_and_restarted(pd, reference, http):
    """Prefill paused in place after its first part landed holds the transfer half done (it computes no
    further chunk) while decode is killed; prefill resumes into a grant whose server is gone, and
    decode is started again. On NIXL only: a decode restart costs minutes of CI's 90, and what it tests
    (a grant whose server is gone, revoked at prefill) is the brokers' whatever the engine; the vLLM
    module kills decode on both engines."""
    if pd.engine != "nixl":
        pytest.skip("decode killed runs on NIXL only (CI time; the failure path is the brokers')")
    prompt = prompts_of(pd, 1, 40 * CHUNK_TOKENS, 61)[0]  # 40 parts
    before = await stack.broker_holds(pd.brokers["prefill"])
    request = asyncio.ensure_future(client.generate(http, pd.url, prompt, ANSWER_TOKENS))

    async def transferring():
        now = await stack.broker_holds(pd.brokers["prefill"])
        return request.done() or now["transferring"] > before["transferring"]

    assert await until_awaited(transferring, timeout=120), "the prefill broker never started the transfer"
    await post(http, pd.prefill.url + "/pause_generation", {"mode": "in_place"})
    try:
        held = await stack.broker_holds(pd.brokers["prefill"])
        assert held["live_requests"] > 0 and held["succeeded"] == before["succeeded"], \
            f"the transfer ended before decode was killed; nothing was cut: {held}"
        await pd.decode.kill()
    finally:
        await post(http, pd.prefill.url + "/continue_generation", {})
    with contextlib.suppress(Exception):  # cut with its decode server: it fails, however the router says it
        await asyncio.wait_for(request, 120)
    await pd.start_decode()
    await settled(pd, reference, http)
    answer = await client.generate(http, pd.url, prompt, ANSWER_TOKENS)  # the same request, again
    assert (why := await reference.mismatch(prompt, answer.output_ids)) is None, why
    await settled(pd, reference, http)


async def test_prefill_broker_restarted_between_requests(pd, reference, http):
    """Prefill's server makes no call between requests; its engine is back on the new broker before
    decode's next offer reaches it."""
    await restart_broker_then_ask(pd, reference, http, "prefill", prompts_of(pd, 1, 100, 71)[0])
