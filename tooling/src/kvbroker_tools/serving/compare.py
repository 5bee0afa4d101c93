"""kvbroker beside SGLang's own mooncake backend on the same real servers: the demo and the benchmark.

`deployments` starts the PD deployments to compare (SGLang's router, a prefill and a decode server
each; kvbroker's with a broker per server) one after another, so that their start-ups do not
compete, and stops them all however the block ends. `interleaved_ttft` sends the same prompts to
each in turn, one request at a time, so load and noise fall on all alike, and with `pausing` the
deployments not asked are paused meanwhile (`only`); `interleaved_batches` does the same with a batch
sent at once to each in turn; `throughput` sends a batch at once to one deployment.
Each takes `ask`, the request of one engine's API (SGLang's `client.generate` by default; vLLM's
`vllm_stack.complete`), and pauses any deployment that has `pause` and `resume`.
`run_stopping_on_signals` is asyncio.run for the demos and benchmarks that start them: SIGTERM or
SIGINT ends the run through its blocks, which stop what they started.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvbroker_tools import threads
from kvbroker_tools.launch import stopping_on_signals
from kvbroker_tools.serving import client, stack

# ask(http, url, prompt token ids, tokens to generate) -> the streamed, greedy answer
Ask = Callable[..., Awaitable[client.Answer]]


class Pausable(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


LABELS = {"kvbroker-nixl": ("kvbroker", "nixl"), "kvbroker-mooncake": ("kvbroker", "mooncake"),
          "mooncake": ("mooncake", "mooncake")}


class Stoppable(Protocol):
    async def stop(self) -> None: ...


T = TypeVar("T")


def run_stopping_on_signals(main: Awaitable[T]) -> T:
    """asyncio.run(main), where SIGTERM and SIGINT cancel it, so that the `started`/`deployments` blocks
    it is in stop their servers and brokers before the process ends (killed, a run left its servers
    running); an interrupted run exits 130."""
    try:
        return asyncio.run(stopping_on_signals(main))
    except asyncio.CancelledError:
        print(f"{Path(sys.argv[0]).name}: interrupted; what it started is stopped", file=sys.stderr)
        raise SystemExit(130) from None


@contextlib.asynccontextmanager
async def started(starters: Mapping[str, Callable[[], Awaitable[Any]]]) -> AsyncIterator[dict[str, Any]]:
    """Each deployment started by its starter, one after another so that their start-ups do not
    compete; every one started is stopped however the block ends."""
    made: dict[str, Stoppable] = {}
    try:
        for label, start in starters.items():
            made[label] = await start()
        yield made
    finally:
        for deployment in made.values():
            with contextlib.suppress(Exception):
                await deployment.stop()


@contextlib.asynccontextmanager
async def deployments(model: Path, log_dir: Path, labels: Sequence[str], *, prefill_args: Sequence[str] = (),
                      decode_args: Sequence[str] = (),
                      env: dict[str, str] | None = None) -> AsyncIterator[dict[str, stack.PDStack]]:
    """`env`: both servers' extra environment in every deployment (the MiniMax model's, for one)."""
    def starter(label: str) -> Callable[[], Awaitable[stack.PDStack]]:
        transfer, engine = LABELS[label]
        return functools.partial(stack.start_pd, model, log_dir / label, transfer=transfer, engine=engine,
                                 prefill_args=prefill_args, decode_args=decode_args, env=env)

    async with started({label: starter(label) for label in labels}) as made:
        yield made


@dataclass
class Series:
    ttft_s: list[float]
    answers: list[list[int]]
    posted_at: list[float] = field(default_factory=list)  # each sample's POST, unix seconds (the trace's clock)
    threads: dict = field(default_factory=dict)  # with `measuring`: (role, thread group) -> threads.Times, summed

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1000


def only(deployments: Mapping[str, Pausable] | None, label: str) -> None:
    """Resume `label`'s deployment and pause every other (None: leave them all running)."""
    if deployments is None:
        return
    for other, deployment in deployments.items():
        if other != label:
            deployment.pause()
    deployments[label].resume()


async def interleaved_ttft(http, urls: dict[str, str], prompts: list[list[int]], tokens: int,
                           warmup: int = 2, *, pausing: Mapping[str, Pausable] | None = None,
                           ask: Ask = client.generate,
                           measuring: Mapping[str, Mapping[str, list[int]]] | None = None) -> dict[str, Series]:
    """`pausing`: the deployments by label; each request then runs with the others paused (`only`).
    `measuring`: per label, its processes by role; each request's threads' CPU and run-queue delay, from
    before its POST to its answer's end (kvbroker_tools.threads), are summed into its Series' `threads`."""
    for label, url in urls.items():  # first requests pay for lazy set-up (handshakes, allocations)
        only(pausing, label)
        for prompt in prompts[:warmup]:
            await ask(http, url, prompt, tokens)
    series = {label: Series([], []) for label in urls}
    for prompt in prompts:
        for label, url in urls.items():
            only(pausing, label)
            processes = measuring.get(label) if measuring else None
            before = await asyncio.to_thread(threads.snapshot, processes) if processes else {}
            posted_at = time.time()
            answer = await ask(http, url, prompt, tokens)
            if processes:
                after = await asyncio.to_thread(threads.snapshot, processes)
                threads.accumulate(series[label].threads, threads.spent(before, after))
            series[label].posted_at.append(posted_at)
            series[label].ttft_s.append(answer.ttft_s)
            series[label].answers.append(answer.output_ids)
    return series


async def interleaved_batches(http, urls: dict[str, str], batches: list[list[list[int]]], tokens: int, *,
                              pausing: Mapping[str, Pausable] | None = None,
                              ask: Ask = client.generate) -> dict[str, Series]:
    """Each batch sent at once to each deployment in turn (the next deployment once the last answer of
    the batch came): every request's TTFT, and the answers in the batches' order."""
    series = {label: Series([], []) for label in urls}
    for batch in batches:
        for label, url in urls.items():
            only(pausing, label)
            posted_at = time.time()
            answers = await asyncio.gather(*(ask(http, url, prompt, tokens) for prompt in batch))
            series[label].posted_at += [posted_at] * len(answers)
            series[label].ttft_s += [a.ttft_s for a in answers]
            series[label].answers += [a.output_ids for a in answers]
    return series


async def throughput(http, url: str, prompts: list[list[int]], tokens: int, *, ask: Ask = client.generate) -> dict:
    started = time.perf_counter()
    answers = await asyncio.gather(*(ask(http, url, p, tokens) for p in prompts))
    elapsed = time.perf_counter() - started
    ttfts = sorted(a.ttft_s for a in answers)
    return {"requests": len(prompts), "seconds": round(elapsed, 3), "requests_per_s": round(len(prompts) / elapsed, 3),
            "ttft_median_ms": round(statistics.median(ttfts) * 1000, 2),
            "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000, 2)}


def ttft_summary(series: Series) -> dict:
    """A series' TTFT in ms: median, p90, mean and every sample."""
    ttft = sorted(series.ttft_s)
    return {"median_ms": round(series.median_ms, 2), "p90_ms": round(ttft[int(0.9 * (len(ttft) - 1))] * 1000, 2),
            "mean_ms": round(statistics.mean(ttft) * 1000, 2),
            "samples_ms": [round(t * 1000, 2) for t in series.ttft_s]}


def git_commit() -> str:
    """The checkout's short commit, or "" outside git: which code a result measured."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(load_before: tuple[float, float, float]) -> dict:
    """The machine a result was measured on, with its load average before the run and now."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
