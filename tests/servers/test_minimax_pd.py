"""The MiniMax-M3-shaped model (3 dense + 4 K-only sparse layers, tooling/src/kvbroker_tools/serving/minimax.py)
through SGLang 0.5.23 prefill and decode servers, SGLang's router and a kvbroker broker per server,
on each transfer engine: every answer's greedy tokens equal a non-PD reference server's.

The PD transfer moves three components: the sparse layers' K and V (MAIN_KV), their index K
(MINIMAX_INDEX_K) and the dense layers' K and V (MINIMAX_DENSE_KV). The CPU stand-in for the sparse
attention picks the blocks each query attends over from the index K it reads in decode's pool, so
the answer depends on the index K having arrived: `test_decode_answers_depend_on_its_index_k` shows
it, by reading decode's index K wrongly (minimax.CORRUPT_ENV) and seeing the tokens change.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio

from kvbroker_tools.serving import client, minimax, stack
from tests.support import sglang_servers
from tests.support.reference import ANSWER_TOKENS, Reference
from tests.support.sglang_servers import (
    CHUNK_TOKENS,
    SERVER_ENV,
    disconnect_after_bootstrap,
    disconnect_before_bootstrap,
    restart_broker_then_ask,
    settled,
)

# The servers run the model's experts eagerly (minimax.SERVER_ENV, TORCH_COMPILE_DISABLE): compiled, a
# server's first request waited minutes for inductor's C++ builds, and three of them starting together
# never answered /health_generate within the start-up bound.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]  # a server start may take its 600 s bound

# One transfer engine: what this module adds over the Llama stack (which runs both) is the three
# components and the index-K rules, the broker's and the plugin's whatever the engine, and both engines
# move MiniMax-shaped requests in tests/integration. A second deployment here cost 8 of CI's 90 minutes.
ENGINES = ["nixl"]
MINIMAX_ENV = {"KVBROKER_SERVING_MINIMAX": "1", **minimax.SERVER_ENV, **SERVER_ENV}
# sglang_servers.PREFILL_ARGS: --chunked-prefill-size and --log-requests (the disconnect case reads prefill's log)
PREFILL_ARGS = (*minimax.SERVER_ARGS, *sglang_servers.PREFILL_ARGS)


@pytest.fixture(scope="module")
def minimax_model() -> Path:
    return minimax.minimax()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def minimax_reference(minimax_model, log_root, http):
    server = await stack.start_server("reference", minimax_model, log_root / "minimax-reference",
                                      args=minimax.SERVER_ARGS, env=MINIMAX_ENV, wait=False)
    async with Reference(server, http) as made:
        yield made


@pytest.fixture(scope="module")
def corruption_switch(tmp_path_factory) -> Path:
    """The file decode's stand-in reads its index-K mode from at every use (empty: read it as it is)."""
    path = tmp_path_factory.mktemp("minimax") / "index-k-mode"
    path.write_text("")
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=ENGINES)
async def minimax_pd(request, minimax_model, log_root, minimax_reference, corruption_switch):
    deployment = await stack.start_pd(minimax_model, log_root / f"minimax-pd-{request.param}", transfer="kvbroker",
                                      engine=request.param, prefill_args=PREFILL_ARGS,
                                      decode_args=minimax.SERVER_ARGS, env=MINIMAX_ENV,
                                      decode_env={minimax.CORRUPT_ENV: str(corruption_switch)})
    yield deployment
    await deployment.stop()


async def test_minimax_greedy_tokens_equal_the_reference_servers(minimax_pd, minimax_reference, http):
    for length in (5, 40, 3 * CHUNK_TOKENS + 9):
        prompt = client.prompts(1, length, seed=300 + length)[0]
        answer = await client.generate(http, minimax_pd.url, prompt, ANSWER_TOKENS)
        why = await minimax_reference.mismatch(prompt, answer.output_ids)
        assert why is None, f"prompt of {length} tokens: {why}"
    await settled(minimax_pd, minimax_reference, http)


async def test_minimax_8_concurrent_requests(minimax_pd, minimax_reference, http):
    prompts = client.prompts(8, 90, seed=308)
    answers = await asyncio.gather(*(client.generate(http, minimax_pd.url, p, ANSWER_TOKENS) for p in prompts))
    wrong = {i: why for i, (a, p) in enumerate(zip(answers, prompts))
             if (why := await minimax_reference.mismatch(p, a.output_ids))}
    assert not wrong, f"requests answered other tokens than the reference: {wrong}"
    await settled(minimax_pd, minimax_reference, http)


async def test_minimax_request_whose_prefix_decode_holds(minimax_pd, minimax_reference, http):
    """Decode's radix cache holds the first prompt: the longer one's index K moves only after that
    prefix (SGLang's truncation to decode's side), the dense layers' KV whole, and the answer still
    equals the reference's."""
    first = client.prompts(1, 2 * CHUNK_TOKENS, seed=310)[0]
    await client.generate(http, minimax_pd.url, first, ANSWER_TOKENS)
    longer = first + client.prompts(1, 40, seed=311)[0]
    answer = await client.generate(http, minimax_pd.url, longer, ANSWER_TOKENS)
    assert answer.meta.get("cached_tokens", 0) > 0, f"decode found no prefix: {answer.meta}"
    assert (why := await minimax_reference.mismatch(longer, answer.output_ids)) is None, why
    await settled(minimax_pd, minimax_reference, http)


async def test_decode_answers_depend_on_its_index_k(minimax_pd, minimax_reference, http, corruption_switch):
    prompt = client.prompts(1, 120, seed=309)[0]
    corruption_switch.write_text("negate")
    try:
        answer = await client.generate(http, minimax_pd.url, prompt, ANSWER_TOKENS)
    finally:
        corruption_switch.write_text("")
    assert await minimax_reference.mismatch(prompt, answer.output_ids), \
        "decode answered the same with its index K read wrongly: equal tokens would not show it arrived"
    await settled(minimax_pd, minimax_reference, http)


async def test_minimax_client_that_disconnects_after_bootstrap(minimax_pd, minimax_reference, http):
    """Decode holds the three components when the client goes: its abort frees the sparse, index-K
    and dense pages, and prefill's broker forgets the finished grant."""
    await disconnect_after_bootstrap(minimax_pd, minimax_reference, http, client.prompts(1, 130, seed=312)[0])


async def test_minimax_client_that_disconnects_before_bootstrap(minimax_pd, minimax_reference, http):
    """Prefill holds the request unbootstrapped when the client goes: no component's offer is left
    on either broker, and the next request answers as the reference does."""
    await disconnect_before_bootstrap(minimax_pd, minimax_reference, http, client.prompts(1, 130, seed=313)[0])


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_minimax_broker_restarted_between_requests(minimax_pd, minimax_reference, http, side):
    """The server's engine is back on the new broker with no call of its own; the next request moves
    all three components through it."""
    prompt = client.prompts(1, 100, seed=314 if side == "prefill" else 315)[0]
    await restart_broker_then_ask(minimax_pd, minimax_reference, http, side, prompt)

