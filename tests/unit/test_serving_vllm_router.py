"""What vllm-router 0.1.17 (the real binary, from .venv-vllm) does with a PD request's kv_transfer_params,
seen from two HTTP endpoints standing in for the prefill and decode servers: a KV connector of ours
relies on it to carry its own parameters from prefill's answer into decode's request."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from kvbroker_tools.serving import vllm_stack
from kvbroker_tools.serving.stack import ServerProcess

PREFILL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "prefill-7",
                  "kvbroker": {"v": 1, "broker_address": "127.0.0.1:9", "engines": [[0, 0, "prefill-0/tp0"]]},
                  "custom": "top-level"}


def worker(role: str, seen: list[dict]) -> web.Application:
    """Answers health and metrics probes; records each completion request; prefill answers with
    PREFILL_PARAMS, decode streams one token."""
    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append({"headers": dict(request.headers), "body": await request.json()})
        if role == "prefill":
            choice = {"index": 0, "text": "", "token_ids": [5], "finish_reason": "length"}
            return web.json_response({"id": "cmpl-p", "object": "text_completion", "model": "m",
                                      "choices": [choice], "kv_transfer_params": PREFILL_PARAMS})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps({"choices": [{"index": 0, "token_ids": [6]}]}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def probe(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/{probe:health|metrics}", probe)
    return app


@pytest.fixture
async def exchange(tmp_path) -> dict[str, list[dict]]:
    """One streamed completion through a real vllm-router: the requests each side received."""
    seen: dict[str, list[dict]] = {"prefill": [], "decode": []}
    runners, sides = [], {}
    router = None
    try:
        for role in seen:
            runner = web.AppRunner(worker(role, seen[role]))
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            sides[role] = ServerProcess(role, None, url, tmp_path / f"{role}.log", [], {})  # type: ignore[arg-type]
        router = await vllm_stack.start_router(sides["prefill"], sides["decode"], tmp_path, timeout=60)
        async with aiohttp.ClientSession() as http:
            answer = await vllm_stack.complete(http, router.url, [1, 2, 3], 4, timeout=60)
        assert answer.output_ids == [6]
        yield seen
    finally:
        if router is not None:
            await router.stop()
        for runner in runners:
            await runner.cleanup()


def test_prefill_is_asked_for_one_token_with_do_remote_decode(exchange):
    [prefill] = exchange["prefill"]
    assert prefill["body"]["max_tokens"] == 1 and prefill["body"]["stream"] is False
    assert prefill["body"]["kv_transfer_params"]["do_remote_decode"] is True


def test_decode_gets_every_key_of_prefills_kv_transfer_params_as_prefill_gave_them(exchange):
    [decode] = exchange["decode"]
    assert decode["body"]["kv_transfer_params"] == PREFILL_PARAMS
    assert decode["body"]["prompt"] == [1, 2, 3] and decode["body"]["max_tokens"] == 4


def test_both_sides_get_the_same_request_id_header(exchange):
    [prefill], [decode] = exchange["prefill"], exchange["decode"]
    assert prefill["headers"]["X-Request-ID"] == decode["headers"]["X-Request-ID"]

