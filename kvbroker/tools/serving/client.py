"""Asking the servers: `generate` sends token ids to SGLang's `/generate` (a server or the router) and
returns the greedy answer's token ids with its time to first token; `prompts` makes token-id prompts.

Requests are greedy (temperature 0) and `ignore_eos`, so an answer is always `max_new_tokens` long and
every token after the first depends on the KV cache decode holds.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

REQUEST_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Answer:
    output_ids: list[int]
    ttft_s: float  # from sending the request to the first streamed chunk that holds a token
    latency_s: float
    meta: dict


def sampling(max_new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


async def generate(session, url: str, input_ids: list[int], max_new_tokens: int = 8, *, rid: str | None = None,
                   timeout: float = REQUEST_TIMEOUT_S) -> Answer:
    """One streamed request; raises RuntimeError naming the status and body when the server refuses it."""
    import aiohttp

    body = {"input_ids": input_ids, "sampling_params": sampling(max_new_tokens), "stream": True}
    if rid is not None:
        body["rid"] = rid
    started = time.perf_counter()
    first = None
    output_ids: list[int] = []
    meta: dict = {}
    async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/generate: HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"POST {url}/generate: the stream says {chunk['error']}")
            ids = chunk.get("output_ids") or []
            if ids and first is None:
                first = time.perf_counter()
            output_ids = _extend(output_ids, ids)
            meta = chunk.get("meta_info", meta)
    ended = time.perf_counter()
    if first is None:
        raise RuntimeError(f"POST {url}/generate: the stream ended without a token (meta {meta})")
    return Answer(output_ids, first - started, ended - started, meta)


def _extend(held: list[int], ids: list[int]) -> list[int]:
    """SGLang streams either every id so far or only the new ones (--incremental-streaming-output)."""
    if len(ids) >= len(held) and ids[:len(held)] == held:
        return list(ids)
    return held + list(ids)


def prompts(count: int, length: int, *, vocab: int = 2048, seed: int = 0, first_id: int = 3) -> list[list[int]]:
    """`count` random prompts of `length` token ids (ids below `first_id` are the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(first_id, vocab) for _ in range(length)] for _ in range(count)]


async def first_token_then_drop(session, url: str, input_ids: list[int], max_new_tokens: int = 64,
                                timeout: float = REQUEST_TIMEOUT_S) -> list[int]:
    """A client that reads the first streamed token and then closes its connection mid-request."""
    import aiohttp

    body = {"input_ids": input_ids, "sampling_params": sampling(max_new_tokens), "stream": True}
    async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/generate: HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                ids = json.loads(line[len("data:"):]).get("output_ids") or []
                if ids:
                    response.close()  # drops the connection: the router and the servers see the client go
                    return ids
    raise RuntimeError(f"POST {url}/generate: the stream ended before its first token")
