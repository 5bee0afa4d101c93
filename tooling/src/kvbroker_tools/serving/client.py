"""Asking the servers: `generate` sends token ids to SGLang's `/generate` (a server or the router) and
returns the greedy answer's token ids with its time to first token; `prompts` makes token-id prompts;
`greedy` asks a reference server for its answer with each position's runner-up, and `mismatch` says
whether another server's answer is a greedy one by it.

Requests are greedy (temperature 0) and `ignore_eos`, so an answer is always `max_new_tokens` long and
every token after the first depends on the KV cache decode holds.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

REQUEST_TIMEOUT_S = 240.0
# Two candidate tokens whose log-probabilities lie closer than this are a tie: the same sums in another
# order (a batch of other requests, another chunking) may pick either one on any server. A page missing,
# misplaced or stale moves the logits by far more. (Seen in float16: prompt 17 of the 32 concurrent
# requests tied its first token exactly, and the PD pair answered the runner-up in 2 full runs of ~10.)
TIE_NATS = 1e-3


@dataclass(frozen=True)
class Answer:
    output_ids: list[int]
    ttft_s: float  # from sending the request to the first streamed chunk that holds a token
    latency_s: float
    meta: dict


@dataclass(frozen=True)
class Greedy:
    """A greedy answer and, per position, its runner-up token and how far behind it lies (nats)."""

    ids: list[int]
    runner_up: list[tuple[int, float]]


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


async def greedy(session, url: str, input_ids: list[int], max_new_tokens: int,
                 timeout: float = REQUEST_TIMEOUT_S) -> Greedy:
    """One request, not streamed, with the two best tokens' log-probabilities at each position."""
    import aiohttp

    body = {"input_ids": input_ids, "sampling_params": sampling(max_new_tokens), "return_logprob": True,
            "top_logprobs_num": 2}
    async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/generate: HTTP {response.status}: {(await response.text())[:500]}")
        made = await response.json()
    runner_up = []
    for token, ((best, best_id, *_), (other, other_id, *_)) in zip(made["output_ids"],
                                                                  made["meta_info"]["output_top_logprobs"]):
        runner_up.append((other_id if best_id == token else best_id, abs(best - other)))
    return Greedy(made["output_ids"], runner_up)


async def mismatch(fetch: Callable[[list[int], int], Awaitable[Greedy]], prompt: list[int], got: list[int],
                   tokens: int) -> str | None:
    """Why `got` is not a greedy answer of `tokens` tokens to `prompt`, or None when it is; `fetch(prompt,
    n)` is the reference's greedy answer. Where the reference's best two tokens tie (TIE_NATS) either one
    is greedy, and the check goes on from the prompt extended by `got`'s choice: every token is checked."""
    if len(got) != tokens:
        return f"{len(got)} tokens where {tokens} were asked for"
    done = 0
    while done < tokens:
        want = await fetch(prompt + got[:done], tokens - done)
        diverge = next((k for k, token in enumerate(want.ids) if got[done + k] != token), None)
        if diverge is None:
            return None
        position = done + diverge
        second, margin = want.runner_up[diverge]
        if got[position] != second or margin > TIE_NATS:
            return (f"token {position} is {got[position]} where the reference answers {want.ids[diverge]} "
                    f"(its runner-up {second}, {margin:.3g} nats behind)")
        done = position + 1
    return None


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
