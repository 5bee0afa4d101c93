"""kvbroker beside SGLang's own mooncake backend on the same real servers: the demo and the benchmark.

`deployments` starts the PD deployments to compare (SGLang's router, a prefill and a decode server
each; kvbroker's with a broker per server) one after another, so that their start-ups do not
compete, and stops them all however the block ends. `interleaved_ttft` sends the same prompts to
each in turn, one request at a time, so load and noise fall on all alike, and with `pausing` the
deployments not asked are paused meanwhile (`only`); `throughput` sends a batch at once to each,
one deployment at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbroker.tools.serving import client, stack

LABELS = {"kvbroker-nixl": ("kvbroker", "nixl"), "kvbroker-mooncake": ("kvbroker", "mooncake"),
          "mooncake": ("mooncake", "mooncake")}


@contextlib.asynccontextmanager
async def deployments(model: Path, log_dir: Path, labels: Sequence[str], *, prefill_args: Sequence[str] = (),
                      decode_args: Sequence[str] = (),
                      env: dict[str, str] | None = None) -> AsyncIterator[dict[str, stack.PDStack]]:
    """`env`: both servers' extra environment in every deployment (the MiniMax model's, for one)."""
    started: dict[str, stack.PDStack] = {}
    try:
        for label in labels:
            transfer, engine = LABELS[label]
            started[label] = await stack.start_pd(model, log_dir / label, transfer=transfer, engine=engine,
                                                  prefill_args=prefill_args, decode_args=decode_args, env=env)
        yield started
    finally:
        for deployment in started.values():
            with contextlib.suppress(Exception):
                await deployment.stop()


@dataclass
class Series:
    ttft_s: list[float]
    answers: list[list[int]]
    posted_at: list[float] = field(default_factory=list)  # each sample's POST, unix seconds (the trace's clock)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1000


def only(deployments: dict[str, stack.PDStack] | None, label: str) -> None:
    """Resume `label`'s deployment and pause every other (None: leave them all running)."""
    if deployments is None:
        return
    for other, deployment in deployments.items():
        if other != label:
            deployment.pause()
    deployments[label].resume()


async def interleaved_ttft(http, urls: dict[str, str], prompts: list[list[int]], tokens: int,
                           warmup: int = 2, *, pausing: dict[str, stack.PDStack] | None = None) -> dict[str, Series]:
    """`pausing`: the deployments by label; each request then runs with the others paused (`only`)."""
    for label, url in urls.items():  # first requests pay for lazy set-up (handshakes, allocations)
        only(pausing, label)
        for prompt in prompts[:warmup]:
            await client.generate(http, url, prompt, tokens)
    series = {label: Series([], []) for label in urls}
    for prompt in prompts:
        for label, url in urls.items():
            only(pausing, label)
            posted_at = time.time()
            answer = await client.generate(http, url, prompt, tokens)
            series[label].posted_at.append(posted_at)
            series[label].ttft_s.append(answer.ttft_s)
            series[label].answers.append(answer.output_ids)
    return series


async def throughput(http, url: str, prompts: list[list[int]], tokens: int) -> dict:
    started = time.perf_counter()
    answers = await asyncio.gather(*(client.generate(http, url, p, tokens) for p in prompts))
    elapsed = time.perf_counter() - started
    ttfts = sorted(a.ttft_s for a in answers)
    return {"requests": len(prompts), "seconds": round(elapsed, 3), "requests_per_s": round(len(prompts) / elapsed, 3),
            "ttft_median_ms": round(statistics.median(ttfts) * 1000, 2),
            "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000, 2)}
