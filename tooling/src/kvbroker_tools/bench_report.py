"""The bench's verdicts and its terminal table: `TARGETS` judged on a report (`judge`), the machine
it ran on (`machine`), and the report as text (`render`). Called by bench.py once every section ran.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import operator
import os
import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvbroker_tools.shapes import PATTERNS, MiB


@dataclass(frozen=True)
class Target:
    key: str
    text: str
    threshold: float
    higher_is_better: bool = True

    def met(self, figure: float | None) -> bool | None:
        if figure is None:
            return None
        return figure >= self.threshold if self.higher_is_better else figure <= self.threshold


TARGETS = {
    "ratio": Target("ratio", "broker/direct >= 0.95 at >= 64 MiB", 0.95),
    "runs16": Target("runs16", "runs-of-16 >= 0.8 x contiguous (>= 64 MiB)", 0.8),
    "p50": Target("p50", "one-page Transfer p50 <= 1 ms", 1.0, higher_is_better=False),
    "rps": Target("rps", ">= 2000 req/s at concurrency 128", 2000.0),
    "p50_floor": Target("p50_floor", "one-part one-page Transfer p50 <= 2x floor", 2.0, higher_is_better=False),
    "rps_claimed": Target("rps_claimed", "offered req/s >= 2x claimed at conc 128", 2.0),
    "planner": Target("planner", "planner >= 50M page ids/s at 10^7", 50e6),
}
RATIO_FROM_MIB = 64


def judge(report: dict) -> list[dict]:
    """One row per target and subject: the figure it is judged on, and whether it is met."""
    verdicts = []

    def add(target: Target, subject: str, figure: float | None, detail: str) -> None:
        verdicts.append({"target": target.key, "text": target.text, "subject": subject,
                         "figure": None if figure is None else round(figure, 4),
                         "threshold": target.threshold, "met": target.met(figure), "detail": detail})

    data = report.get("data_plane")
    if data:
        cases = data["cases"]
        for backend in dict.fromkeys(c["backend"] for c in cases):
            big = [c for c in cases if c["backend"] == backend and c["size_mib"] >= RATIO_FROM_MIB]
            for pattern in PATTERNS:
                mine = [c for c in big if c["pattern"] == pattern]
                for key, baseline in (("ratio", "direct in 1 process"), ("ratio_vs_direct2", "direct in 2")):
                    worst = min(mine, key=operator.itemgetter(key), default=None)
                    add(TARGETS["ratio"], f"{backend} {pattern} vs {baseline}", worst and worst[key],
                        f"lowest over {[c['size_mib'] for c in mine]} MiB"
                        + (f" (at {worst['size_mib']} MiB)" if worst else ": no size >= 64 MiB in this run"))
            for path in ("direct", "broker"):
                pairs = {}
                for c in big:
                    pairs.setdefault(c["size_mib"], {})[c["pattern"]] = c[f"{path}_gbps"]
                fractions = {s: p["runs16"] / p["contiguous"] for s, p in pairs.items()
                             if "runs16" in p and "contiguous" in p}
                worst_size = min(fractions, key=fractions.get, default=None)
                add(TARGETS["runs16"], f"{backend} {path}", fractions.get(worst_size),
                    f"lowest runs16/contiguous GB/s over {sorted(fractions)} MiB"
                    if fractions else "no size >= 64 MiB in this run")
    control = report.get("control_plane")
    if control:
        floors = {(f["backend"], f["client_loop"], f["concurrency"]): f for f in control["rpc_floor"]}
        for r in control["runs"]:
            flow = r.get("flow", "claimed")
            subject = f"{r['backend']} {flow} client {r['client_loop']}"
            floor = floors.get((r["backend"], r["client_loop"], r["concurrency"]))
            if r["concurrency"] == 1:
                add(TARGETS["p50"], subject, r["transfer_ms"]["p50"], f"p99 {r['transfer_ms']['p99']} ms")
                if flow == "offered":
                    add(TARGETS["p50_floor"], subject, r.get("transfer_p50_vs_floor"),
                        f"Transfer p50 {r['transfer_ms']['p50']} ms, floor p50 "
                        f"{floor and floor['call_ms']['p50']} ms; offer + part p50 {r['request_ms']['p50']} ms")
            if r["concurrency"] == 128:
                add(TARGETS["rps"], subject, r["requests_per_s"],
                    f"Transfer p50 {r['transfer_ms']['p50']} ms at concurrency 128")
                if flow == "offered":
                    notify = r.get("notify") or {}
                    add(TARGETS["rps_claimed"], subject, r.get("requests_per_s_vs_claimed"),
                        f"{r['requests_per_s']:.0f} req/s; {notify.get('notices_per_call')} notices per NotifyParts")
    if control and control.get("exchange"):
        from kvbroker_tools import bench_exchange

        for key, text, threshold, higher, figure, detail in bench_exchange.verdicts(control["exchange"]):
            add(Target(key, text, threshold, higher), detail.partition(":")[0], figure, detail.partition(": ")[2])
    plans = report.get("planner")
    if plans:
        for row in plans["rows"]:
            if row["pages"] == 10**7:
                add(TARGETS["planner"], f"{row['pattern']} plan_runs+build_descriptors",
                    row["plan_build_1buffer_ids_per_s"],
                    f"one layer-buffer pair; plan_runs alone {row['plan_runs_ids_per_s'] / 1e6:.1f} M ids/s")
    return verdicts


def machine() -> dict:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "kernel": platform.release(), "commit": commit,
        "packages": {n: version(n) for n in ("nixl", "mooncake-transfer-engine-non-cuda",
                                             "mooncake-transfer-engine", "grpcio", "numpy", "uvloop")},
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", ""),
    }


def _fmt_size(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib >= 1024 and mib % 1024 == 0 else f"{mib} MiB"


def _mark(met: bool | None) -> str:
    return {True: "ok", False: "MISS", None: "n/a"}[met]


def _millions(row: dict, key: str) -> str:
    return f"{row[key] / 1e6:.1f}" if key in row else "-"


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _render_data(data: dict) -> list[str]:
    s = data["shape"]
    lines = ["", (f"Data plane: {s['layers']} layers, page_size {s['page_size_tokens']} tokens, "
                  f"{s['layer_buffers']} layer buffers (MAIN_KV K+V bf16 {s['item_len_bytes']['K']} B, "
                  f"MINIMAX_INDEX_K fp8 {s['item_len_bytes']['INDEX_K']} B a page), "
                  f"{s['bytes_per_page'] // 1024} KiB a page; GB/s, median of {data['timing']['repeats']}"),
             (f"{'backend':9}{'size':>8}{'pages':>7} {'pattern':11}{'runs':>6}{'descs':>8}{'broker':>8}"
              f"{'direct':>8}{'2-proc':>8}{'memcpy':>8}  {'broker/direct':19}{'b/2-proc':>9}  "
              f"{'runs16/contig direct|broker':28}")]
    memcpy = {m["size_mib"]: m["gbps"] for m in data["memcpy"]}
    by_key = {(c["backend"], c["size_mib"], c["pattern"]): c for c in data["cases"]}
    for c in data["cases"]:
        big = c["size_mib"] >= RATIO_FROM_MIB
        ratio = f"{c['ratio']:.3f}" + (f" {_mark(TARGETS['ratio'].met(c['ratio']))} >=0.95" if big else "")
        frac = ""
        contig = by_key.get((c["backend"], c["size_mib"], "contiguous"))
        if c["pattern"] == "runs16" and contig:
            d, b = (c[f"{p}_gbps"] / contig[f"{p}_gbps"] for p in ("direct", "broker"))
            frac = f"{d:.3f}|{b:.3f}"
            if big:
                frac += f" {_mark(TARGETS['runs16'].met(min(d, b)))} >=0.8"
        lines.append(f"{c['backend']:9}{_fmt_size(c['size_mib']):>8}{c['pages']:>7} {c['pattern']:11}"
                     f"{c['runs']:>6}{c['descriptors']:>8}{c['broker_gbps']:>8.2f}{c['direct_gbps']:>8.2f}"
                     f"{c.get('direct2_gbps', float('nan')):>8.2f}{memcpy.get(c['size_mib'], 0):>8.2f}  {ratio:19}"
                     f"{c.get('ratio_vs_direct2', float('nan')):>9.3f}  {frac:28}"
                     f"{'' if c['verified'] else 'NOT VERIFIED'}")
    parts = data.get("parts") or {}
    if parts.get("cases"):
        n = parts["parts"]
        lines += ["", (f"Parts: the {_fmt_size(parts['size_mib'])} request above by the offered flow, as 1 part and as "
                       f"{n} parts one after another (same engines, same page lists); GB/s, median; claimed: the "
                       f"broker column above; engine: the same writes by the engine alone, two processes"),
                  (f"{'backend':9}{'size':>8}{'pages':>7} {'pattern':11}{'claimed':>8}{'1 part':>8}{f'{n} parts':>9}"
                   f"{f'{n}/1':>7}{'ms/part':>9}{'engine 1':>9}{f'engine {n}':>9}{'ms/part':>9}  (ms/part: the time "
                   f"each extra part adds)")]
        for c in parts["cases"]:
            lines.append(f"{c['backend']:9}{_fmt_size(c['size_mib']):>8}{c['pages']:>7} {c['pattern']:11}"
                         f"{_nan(c.get('claimed_gbps')):>8.2f}{c['one_part_gbps']:>8.2f}{c['parts_gbps']:>9.2f}"
                         f"{c['parts_vs_one']:>7.3f}{c['extra_ms_per_part']:>9.2f}"
                         f"{_nan(c.get('direct2_one_gbps')):>9.2f}{_nan(c.get('direct2_parts_gbps')):>9.2f}"
                         f"{_nan(c.get('direct2_extra_ms_per_part')):>9.2f}"
                         f"{'' if c['verified'] else '  NOT VERIFIED'}")
    return lines


def _render_control(control: dict) -> list[str]:
    engine = control["engine"]
    lines = ["", (f"Control plane: grant + one-page Transfer ({engine['page_bytes'] // 1024} KiB over "
                  f"{engine['layer_buffers']} layer buffers), claimed and offered flow side by side, each against "
                  f"the floor (one bare GetBrokerInfo) of its concurrency; varied: the client's loop; brokers on "
                  f"uvloop"),
             "  p50, p99: the Transfer call (offered: the part; its offer was made before, outside the clock); "
             "req p50: grant + Transfer; x floor: Transfer p50 / floor p50; vs claimed: req/s over the claimed "
             "flow's; notices/call: per NotifyParts",
             (f"{'backend':9}{'client':9}{'flow':9}{'conc':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
              f"{'req p50':>9}{'x floor':>8}{'vs claimed':>11}{'notices/call':>13}{'errors':>7}"
              f"{'cpu ms/req P+D+client':>23}{'busy cores':>11}  target")]
    floors = {(f["backend"], f["client_loop"], f["concurrency"]): f for f in control.get("rpc_floor", [])}
    shown = set()
    for r in control["runs"]:
        key = (r["backend"], r["client_loop"], r["concurrency"])
        f = floors.get(key)
        if f is not None and key not in shown:
            shown.add(key)
            cpu = f"{f['cpu_ms_per_call'].get('broker', 0):.2f}+{f['cpu_ms_per_call'].get('client', 0):.2f}"
            lines.append(f"{f['backend']:9}{f['client_loop']:9}{'floor':9}{f['concurrency']:>5}{f['calls_per_s']:>9.0f}"
                         f"{_nan(f['call_ms']['p50']):>9.3f}{_nan(f['call_ms']['p99']):>9.3f}{'':>9}{'':>8}{'':>11}"
                         f"{'':>13}{'':>7}{cpu + '  ':>23}{'':>11}  one GetBrokerInfo (cpu: broker+client)")
        flow = r.get("flow", "claimed")
        targets = []
        if r["concurrency"] == 1:
            targets.append(f"p50 {_mark(TARGETS['p50'].met(r['transfer_ms']['p50']))} <=1 ms")
            if flow == "offered":
                targets.append(f"{_mark(TARGETS['p50_floor'].met(r.get('transfer_p50_vs_floor')))} <=2x floor")
        elif r["concurrency"] == 128:
            targets.append(f"req/s {_mark(TARGETS['rps'].met(r['requests_per_s']))} >=2000")
            if flow == "offered":
                targets.append(f"{_mark(TARGETS['rps_claimed'].met(r.get('requests_per_s_vs_claimed')))} "
                               f">=2x claimed")
        cpu = r.get("cpu_ms_per_request", {})
        split = "+".join(f"{cpu.get(k, float('nan')):.2f}" for k in ("prefill_broker", "decode_broker", "client"))
        vs_claimed = r.get("requests_per_s_vs_claimed")
        per_call = (r.get("notify") or {}).get("notices_per_call")
        lines.append(f"{r['backend']:9}{r['client_loop']:9}{flow:9}{r['concurrency']:>5}{r['requests_per_s']:>9.0f}"
                     f"{_nan(r['transfer_ms']['p50']):>9.3f}{_nan(r['transfer_ms']['p99']):>9.3f}"
                     f"{_nan(r.get('request_ms', {}).get('p50')):>9.3f}{_nan(r.get('transfer_p50_vs_floor')):>8.2f}"
                     f"{'' if vs_claimed is None else f'{vs_claimed:.2f}':>11}"
                     f"{'' if per_call is None else f'{per_call:.2f}':>13}{r['errors']:>7}{split:>23}"
                     f"{r.get('machine_busy_cores', 0):>11.2f}  {', '.join(targets)}")
    return lines


def _render_planner(plans: dict) -> list[str]:
    full = f"plan_build_{plans['full_engine_buffers']}buffers_ids_per_s"
    lines = ["", (f"Planner: M page ids/s: plan_runs; plan_runs + build_descriptors for 1 layer-buffer pair "
                  f"(build1) and for {plans['full_engine_buffers']} (build192); naive Python loop"),
             (f"{'pages':>10} {'pattern':10}{'runs':>10}{'plan':>8}{'build1':>8}{'build192':>9}"
              f"{'naive':>8}{'naive+b1':>9}  target")]
    for row in plans["rows"]:
        target = ""
        if row["pages"] == 10**7:
            target = f"build1 {_mark(TARGETS['planner'].met(row['plan_build_1buffer_ids_per_s']))} >=50"
        lines.append(f"{row['pages']:>10,} {row['pattern']:10}{row['runs']:>10,}"
                     f"{_millions(row, 'plan_runs_ids_per_s'):>8}"
                     f"{_millions(row, 'plan_build_1buffer_ids_per_s'):>8}"
                     f"{_millions(row, full):>9}{_millions(row, 'naive_plan_ids_per_s'):>8}"
                     f"{_millions(row, 'naive_plan_build_1buffer_ids_per_s'):>9}  {target}")
    return lines


def _render_registration(reg: dict) -> list[str]:
    e = reg["engine"]
    lines = ["", (f"Registration: {e['layers']} layers x 3 = {e['layer_buffers']} layer buffers, "
                  f"{e['pages_per_buffer']} pages each ({e['registered_bytes'] / MiB:.0f} MiB); no target")]
    for row in reg["rows"]:
        lines.append(f"  {row['backend']:9} RegisterEngine {row['register_ms']:.1f} ms, "
                     f"UnregisterEngine {row['unregister_ms']:.1f} ms (median)")
    return lines


def render(report: dict) -> str:
    """The terminal table: every section's figures, each target beside the figure it judges."""
    meta = report["meta"]
    lines = [(f"kvbroker bench{' --quick' if report['quick'] else ''}  {meta['date']}  {meta['host']}  "
              f"{meta['cpus']} CPUs ({meta['cpu']}), {meta['memory_gib']} GiB, "
              f"load {meta['load_avg_at_start']}")]
    for key, part in (("data_plane", _render_data), ("control_plane", _render_control),
                      ("planner", _render_planner), ("registration", _render_registration)):
        if report.get(key):
            lines += part(report[key])
        if key == "control_plane" and (report.get(key) or {}).get("exchange"):
            from kvbroker_tools import bench_exchange

            lines += bench_exchange.render(report[key]["exchange"])
        if key == "control_plane" and (report.get(key) or {}).get("followed"):
            from kvbroker_tools import bench_messages

            lines += bench_messages.render(report[key]["followed"])
            lines += bench_messages.render_threads(report[key]["followed"])
    if report["targets"]:
        lines += ["", "Targets"]
        for v in report["targets"]:
            figure = "-" if v["figure"] is None else f"{v['figure']:,.4g}"
            lines.append(f"  {_mark(v['met']):4} {v['text']:44} {v['subject']:34} {figure:>11}  "
                         f"{v['detail']}")
    if report["errors"]:
        lines += ["", "Errors"] + [f"  {e}" for e in report["errors"]]
    return "\n".join(lines)

