"""The control plane's followed rows: a request as the adapters run it, and the messages it costs.

Run inside the control child after each level's Exchange rows (bench_exchange.py), on the same
Exchange clients. A followed request is the offered flow with the watches the adapters keep:
prefill watches the request's end from before the grant (waiting for the offer), decode grants and
waits for the end, prefill sends one one-page part, the last. Two ways, side by side:
- `followed`: one message per step: decode's grant and its end as one command (expect_and_watch),
  the last part's SUCCEEDED reply the end of prefill's watch (end_watches);
- `followed_apart`: the same steps as the adapters sent them before: decode's grant, then a watch
  of its states; prefill's watch ending with its own message beside the part's reply.
Each row has the CPU per request (both brokers and the client) and the gRPC messages per request
each broker's ports read and wrote, per port and method (its /metrics' kvbroker_grpc_messages_total:
a message between the brokers is counted once, on the port that received it), with their sums per
broker and in all, and each process's threads' CPU and run-queue delay per request, by thread group
(kvbroker_tools.threads); bench_report.py prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvbroker_tools import threads
from kvbroker_tools.shapes import ALL

WAYS = ("followed", "followed_apart")
OFFER_WAIT_S = 30.0


async def _end_of(statuses) -> object:
    last = None
    async with contextlib.aclosing(statuses):
        async for status in statuses:
            last = status
    return last


async def followed(config: dict, prefill, decode, rid: str, page: int, *, apart: bool = False) -> tuple[float, float]:
    """One followed request; the seconds of the grant (to its answer) and of the part (to the end on
    both sides)."""
    pages = {c: [page] for c in ALL}
    sender_end = asyncio.ensure_future(_end_of(prefill.watch(
        config["prefill_engine"], rid, terminal_only=True, offer_wait_s=OFFER_WAIT_S)))
    try:
        t0 = time.perf_counter()
        if apart:
            await decode.expect_transfer(config["decode_engine"], rid, pages, sender_address=config["prefill_peer"],
                                         sender_engine_id=config["prefill_engine"], expiry_s=60)
            receiver_end = asyncio.ensure_future(_end_of(decode.watch(config["decode_engine"], rid, states_only=True)))
        else:
            granting = decode.expect_and_watch(config["decode_engine"], rid, pages,
                                               sender_address=config["prefill_peer"],
                                               sender_engine_id=config["prefill_engine"], expiry_s=60)
            await anext(granting)
            receiver_end = asyncio.ensure_future(_end_of(granting))
        t1 = time.perf_counter()
        await prefill.transfer_part(config["prefill_engine"], rid, pages, last=True, end_watches=not apart)
        ends = await asyncio.gather(sender_end, receiver_end)
        t2 = time.perf_counter()
    finally:
        sender_end.cancel()
    if any(end is None or end.state.name != "SUCCEEDED" for end in ends):
        raise RuntimeError(f"the request ended {[getattr(e, 'state', None) for e in ends]}")
    return t1 - t0, t2 - t1


def samples(listen: str) -> list:
    """Every sample of the broker's /metrics at `listen` (host:port)."""
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(listens: dict[str, str]) -> dict[tuple[str, str, str, str], float]:
    """kvbroker_grpc_messages_total of each broker: (broker, port, method, direction) -> count."""
    return {(broker, s.labels["port"], s.labels["method"], s.labels["direction"]): s.value
            for broker, listen in listens.items() for s in samples(listen)
            if s.name == "kvbroker_grpc_messages_total"}


async def messages_over(window, listens: dict[str, str]) -> dict:
    """The messages each broker read and wrote inside the window, per port and method."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, window.begin - loop.time()))
    first = await asyncio.to_thread(scrape, listens)
    await asyncio.sleep(max(0.0, window.end - loop.time()))
    last = await asyncio.to_thread(scrape, listens)
    return {key: last[key] - first.get(key, 0.0) for key in last if last[key] - first.get(key, 0.0)}


def per_request(counts: dict, requests: int) -> dict:
    """Messages per request: per broker, `port method direction` -> n, with each broker's sum and the total."""
    out: dict = {}
    for (broker, port, method, direction), n in sorted(counts.items()):
        out.setdefault(broker, {})[f"{port} {method} {direction}"] = round(n / max(requests, 1), 3)
    for broker in list(out):
        out[broker]["all"] = round(sum(out[broker].values()), 3)
    out["all"] = round(sum(v["all"] for v in out.values()), 3)
    return out


async def level(tools, config: dict, concurrency: int, prefill, decode) -> list[dict]:
    """One window of each way at `concurrency`, on the Exchange clients."""
    loop = asyncio.get_running_loop()
    listens = {"prefill_broker": config["prefill_metrics"], "decode_broker": config["decode_metrics"]}
    processes = {**{name: [pid] for name, pid in config["broker_pids"].items()}, "client": [os.getpid()]}
    rows = []
    for way in WAYS:
        begin = loop.time() + config["warmup_s"]
        window = tools.window(begin, begin + config["seconds"])
        way_config = {**config, "tag": f"{config['tag']}-{way}"}
        cpu, counts, took, _ = await asyncio.gather(
            tools.cpu_over(window, config["broker_pids"]), messages_over(window, listens),
            threads.over(window.begin, window.end, processes),
            asyncio.gather(*(tools.worker(way_config, way, prefill, decode, window, concurrency, w)
                             for w in range(concurrency))))
        row = tools.flow_row(way, concurrency, config["seconds"], window, cpu)
        row["messages_per_request"] = per_request(counts, row["requests"])
        row["threads_per_request"] = threads.per_request(took, row["requests"])
        rows.append(row)
    return rows


def render(rows: list[dict]) -> list[str]:
    """The followed rows as the bench's table prints them."""
    lines = ["", "Followed requests (the offered flow with the adapters' watches), on the Exchange stream: one "
                 "message per step against the same steps apart",
             f"{'backend':9}{'client':9}{'flow':16}{'conc':>5}{'req/s':>8}{'request ms':>11}"
             f"{'msgs P':>8}{'msgs D':>8}{'msgs':>6}{'cpu ms/req P+D+client':>23}{'total':>7}"]
    for r in rows:
        cpu = r.get("cpu_ms_per_request", {})
        parts = [cpu.get(k, float("nan")) for k in ("prefill_broker", "decode_broker", "client")]
        split = "+".join(f"{p:.2f}" for p in parts)
        m = r.get("messages_per_request", {})
        on_p, on_d = m.get("prefill_broker", {}).get("all", 0), m.get("decode_broker", {}).get("all", 0)
        lines.append(f"{r['backend']:9}{r['client_loop']:9}{r['flow']:16}{r['concurrency']:>5}"
                     f"{r['requests_per_s']:>8.0f}{r['request_ms']['p50'] or float('nan'):>11.3f}"
                     f"{on_p:>8.2f}{on_d:>8.2f}{m.get('all', 0):>6.1f}{split:>23}{sum(parts):>7.2f}")
    return lines


def render_threads(rows: list[dict], top: int = 3) -> list[str]:
    """Per followed row and process: ms of CPU / of run-queue delay per request (threads), and its
    busiest thread groups."""
    lines = ["", "Threads per followed request: ms of CPU / of run-queue delay (threads seen), busiest thread groups"]
    for r in rows:
        lines.append(f"{r['backend']} {r['client_loop']} {r['flow']} conc {r['concurrency']}:")
        for role, t in r.get("threads_per_request", {}).items():
            groups = ", ".join(f"{g} {v['cpu_ms']:.2f}/{v['wait_ms']:.2f} ({v['threads']})"
                               for g, v in list(t["groups"].items())[:top])
            lines.append(f"  {role:15}{t['cpu_ms']:7.2f}/{t['wait_ms']:.2f} ({t['threads']})  {groups}")
    return lines
