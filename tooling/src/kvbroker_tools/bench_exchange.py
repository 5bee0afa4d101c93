"""The control plane's Exchange rows: the offered flow on the command stream beside the unary calls.

Run inside the control child (bench_children._control_child), at each concurrency level after that
level's floor and unary flows, with clients whose Transfer, ExpectTransfer and watches go on one
Exchange stream each (kvbroker_client.exchange):
- `ping`: a bare message on the prefill client's stream and its answer, no broker call: the stream's
  own floor;
- `streamed`: the offered flow's request (grant offered to the prefill broker, then one part of one
  page) with both commands on the streams.
`level` returns one row per level with the part's p50 against the ping's (target <= 1.5x) and the
requests/s against the unary floor's calls/s (target >= 0.5x at concurrency 128) and against the
same level's unary offered flow. bench_report.py judges and prints them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TARGET_PART_VS_PING = 1.5
TARGET_RPS_VS_FLOOR = 0.5


async def _ping_worker(client, window) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < window.end:
        started = time.perf_counter()
        await client.exchange.ping(10.0)
        if window.takes(loop.time()):
            window.transfer_s.append(time.perf_counter() - started)


@dataclass(frozen=True)
class Windows:
    """What the control child measures a window with (bench_children.py's, handed in: no import circle)."""

    window: Callable  # Window(begin, end)
    worker: Callable  # _control_worker(config, flow, prefill, decode, window, concurrency, w)
    cpu_over: Callable  # _cpu_over(window, pids, metrics_listen)
    flow_row: Callable  # _flow_row(flow, concurrency, seconds, window, cpu)
    percentiles: Callable


async def level(tools: Windows, config: dict, concurrency: int, prefill, decode, floor: dict,
                offered: dict | None) -> dict:
    """The ping window, then the streamed offered flow's window, at `concurrency`."""
    Window, _control_worker, _cpu_over, _flow_row, _percentiles = (
        tools.window, tools.worker, tools.cpu_over, tools.flow_row, tools.percentiles)
    loop = asyncio.get_running_loop()
    begin = loop.time() + config["warmup_s"]
    window = Window(begin, begin + config["seconds"])
    cpu, _ = await asyncio.gather(_cpu_over(window, {"broker": config["broker_pids"]["prefill_broker"]}),
                                  asyncio.gather(*(_ping_worker(prefill, window) for _ in range(concurrency))))
    pings = len(window.transfer_s)
    ping = {"calls_per_s": pings / config["seconds"], "call_ms": _percentiles(np.asarray(window.transfer_s) * 1e3),
            "cpu_ms_per_call": {k: round(v * 1e3 / max(pings, 1), 4) for k, v in cpu.items()
                                if k != "machine_busy_cores"}}
    begin = loop.time() + config["warmup_s"]
    window = Window(begin, begin + config["seconds"])
    streamed_config = {**config, "tag": f"{config['tag']}-exchange"}
    cpu, _ = await asyncio.gather(
        _cpu_over(window, config["broker_pids"], config.get("prefill_metrics", "")),
        asyncio.gather(*(_control_worker(streamed_config, "offered", prefill, decode, window, concurrency, w)
                         for w in range(concurrency))))
    row = _flow_row("offered", concurrency, config["seconds"], window, cpu)
    row.update(flow="streamed", ping=ping, streams_opened={"prefill": prefill.exchange.streams_opened,
                                                          "decode": decode.exchange.streams_opened})
    part, bare = row["transfer_ms"]["p50"], ping["call_ms"]["p50"]
    if part is not None and bare:
        row["part_p50_vs_ping"] = round(part / bare, 3)
    if floor["call_ms"]["p50"] and part is not None:
        row["part_p50_vs_floor"] = round(part / floor["call_ms"]["p50"], 3)
    if floor["calls_per_s"]:
        row["requests_per_s_vs_floor"] = round(row["requests_per_s"] / floor["calls_per_s"], 4)
    if offered is not None:
        row["unary"] = {"transfer_ms": offered["transfer_ms"], "request_ms": offered["request_ms"],
                        "requests_per_s": offered["requests_per_s"],
                        "cpu_ms_per_request": offered["cpu_ms_per_request"]}
        if offered["requests_per_s"]:
            row["requests_per_s_vs_unary"] = round(row["requests_per_s"] / offered["requests_per_s"], 3)
        if offered["transfer_ms"]["p50"] and part is not None:
            row["part_p50_vs_unary"] = round(part / offered["transfer_ms"]["p50"], 3)
    return row


def render(rows: list[dict]) -> list[str]:
    """The Exchange rows as the bench's table prints them."""
    lines = ["", "Exchange stream: the offered flow's grant and one-page part as commands on one stream per client, "
                 "beside a bare message (ping) on the same stream and the same level's unary offered flow",
             f"{'backend':9}{'client':9}{'conc':>5}{'ping ms':>9}{'part ms':>9}{'x ping':>8}{'unary ms':>9}"
             f"{'req/s':>8}{'x floor':>8}{'x unary':>8}{'errors':>7}{'cpu ms/req P+D+client':>23}  target"]
    for r in rows:
        cpu = r.get("cpu_ms_per_request", {})
        split = "+".join(f"{cpu.get(k, float('nan')):.2f}" for k in ("prefill_broker", "decode_broker", "client"))
        targets = []
        if r["concurrency"] == 1:
            met = (r.get("part_p50_vs_ping") or float("inf")) <= TARGET_PART_VS_PING
            targets.append(f"{'ok' if met else 'MISS'} <={TARGET_PART_VS_PING}x ping")
        if r["concurrency"] == 128:
            met = (r.get("requests_per_s_vs_floor") or 0) >= TARGET_RPS_VS_FLOOR
            targets.append(f"{'ok' if met else 'MISS'} >={TARGET_RPS_VS_FLOOR}x floor")
        unary = (r.get("unary") or {}).get("transfer_ms", {}).get("p50")
        lines.append(f"{r['backend']:9}{r['client_loop']:9}{r['concurrency']:>5}"
                     f"{_num(r['ping']['call_ms']['p50']):>9.3f}{_num(r['transfer_ms']['p50']):>9.3f}"
                     f"{_num(r.get('part_p50_vs_ping')):>8.2f}{_num(unary):>9.3f}{r['requests_per_s']:>8.0f}"
                     f"{_num(r.get('requests_per_s_vs_floor')):>8.3f}{_num(r.get('requests_per_s_vs_unary')):>8.2f}"
                     f"{r['errors']:>7}{split:>23}  {', '.join(targets)}")
    return lines


def verdicts(rows: list[dict]) -> list[tuple[str, str, float, bool, float | None, str]]:
    """(key, text, threshold, higher is better, figure, subject + detail) per judged row."""
    out = []
    for r in rows:
        subject = f"{r['backend']} streamed client {r['client_loop']}"
        if r["concurrency"] == 1:
            out.append(("exchange_part_ping", "Exchange one-page part p50 <= 1.5x a ping on the stream",
                        TARGET_PART_VS_PING, False, r.get("part_p50_vs_ping"),
                        f"{subject}: part p50 {r['transfer_ms']['p50']} ms, ping p50 {r['ping']['call_ms']['p50']} ms"))
        if r["concurrency"] == 128:
            out.append(("exchange_rps_floor", "Exchange req/s >= 0.5x the floor's calls/s at conc 128",
                        TARGET_RPS_VS_FLOOR, True, r.get("requests_per_s_vs_floor"),
                        f"{subject}: {r['requests_per_s']:.0f} req/s, unary offered "
                        f"{(r.get('unary') or {}).get('requests_per_s', 0):.0f}"))
    return out


def _num(value: float | None) -> float:
    return float("nan") if value is None else value
