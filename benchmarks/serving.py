"""Time to first token and requests/s through real SGLang 0.5.23 PD servers: kvbroker beside SGLang's
own mooncake backend, in one run, on the same prompts; and where a kvbroker request's time goes.

    scripts/in-netns.sh .venv/bin/python benchmarks/serving.py [--out FILE] [--engines nixl,mooncake]
                                                               [--model llama|minimax] [--no-trace]

Each deployment is SGLang's router over a prefill and a decode server (tiny Llama, random weights,
built locally; tooling/src/kvbroker_tools/serving) started one after another and all kept up; kvbroker's have
a broker per server. TTFT: the same prompts sent to each deployment in turn, one request at a time
(so load on the machine falls on all alike), streamed, greedy; the time from sending the request to
the first streamed token, with the other deployments paused (SIGSTOP; `--no-pause-others` keeps them
running: an idle SGLang scheduler spins on a core, and on 2 cores the idle deployment's two took CPU
from the measured one). Requests/s: a batch sent at once to one deployment, then the next. Then,
unless `--no-trace` (the trace's ~45 events per kvbroker request bias the ratio against it), with the
trace on (KVBROKER_SERVING_TRACE, tooling/src/kvbroker_tools/serving/trace.py), a kvbroker request's
steps as each process logged them, in ms from the router post; and the median of each step over
every TTFT sample (`timeline_medians`: the trace is on throughout), and per sample (`each`) when
decode waited, saw Success and streamed the first token, and the garbage collections of 2 ms or
more inside its TTFT, by process. JSON to --out, a summary on stdout.
The targets (not tests): kvbroker's median TTFT <= 1.2x mooncake's on the Llama shape, <= 1.1x on the
MiniMax-M3 shape (`--model minimax`: tooling/src/kvbroker_tools/serving/minimax.py, 3 dense + 4 K-only sparse
layers, whose PD transfer moves three components: sparse KV, index K, dense KV).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGETS = {"llama": 1.2, "minimax": 1.1}  # kvbroker's median TTFT / mooncake's, per model


def model_setup(name: str) -> dict:
    """The model's directory, its description, and what its servers need (arguments, environment)."""
    from kvbroker_tools.serving import minimax, models

    if name == "llama":
        return {"path": models.llama(), "args": (), "env": {},
                "shape": "Llama: 2 layers, hidden 128, 4 heads, 2 KV heads, head_dim 32, float32, random weights"}
    if name == "minimax":
        return {"path": minimax.minimax(), "args": minimax.SERVER_ARGS,
                "env": {"KVBROKER_SERVING_MINIMAX": "1", **minimax.SERVER_ENV},
                "shape": f"MiniMax-M3: {minimax.DENSE_LAYERS} dense + {minimax.SPARSE_LAYERS} K-only sparse layers "
                         "(CPU stand-in that selects blocks by the index K), small MoE, hidden 64, float32, "
                         "random weights; PD moves sparse KV, index K and dense KV"}
    raise ValueError(f"--model: {name!r} is neither 'llama' nor 'minimax'")


def timeline(events: list[dict], post_t: float, room: str) -> list[dict]:
    """The traced events of one request (its room), in ms from the router post."""
    mine = [e for e in events if room in e["key"].split(",") and e["t"] >= post_t - 1]
    return [{"ms": round((e["t"] - post_t) * 1000, 2), "event": e["event"], "pid": e["pid"],
             **{k: v for k, v in e.items() if k not in ("t", "event", "pid", "key")}} for e in mine]


def step_name(step: dict) -> str:
    """A traced step's row: its event, with the state, the part's kind or the span's phase."""
    name = step["event"]
    if "state" in step:
        name += f" {step['state']}"
    if step["event"] in ("client.transfer_part", "prefill.send"):
        name += " (last)" if step.get("last") else " (not last)"
    if "phase" in step:
        name += f" {step['phase']}"
    return name


def median_timeline(events: list[dict], series: dict) -> dict:
    """Every TTFT sample's traced steps (kvbroker's, and mooncake's at the steps it shares) in ms from
    its router post, and per step the median over the samples (a step a request takes more than
    once, a part's, is one row per occurrence).
    The samples went one at a time, so a sample's room is the one decode sent metadata for between
    its post and the next."""
    posts = sorted(t for s in series.values() for t in s.posted_at)
    metadata = [e for e in events if e["event"] == "decode.send_metadata"]
    result = {}
    for label, s in series.items():
        rows: dict[str, list[float]] = {}
        each = []  # per sample, in order: where its slow ones lost their time
        for post, ttft in zip(s.posted_at, s.ttft_s):
            end = next((t for t in posts if t > post), float("inf"))
            rooms = {e["key"] for e in metadata if post <= e["t"] < end}
            if len(rooms) != 1:
                continue
            seen: dict[str, int] = {}
            steps = timeline(events, post, rooms.pop()) + [{"ms": ttft * 1000, "event": "client.first_token"}]
            for step in sorted(steps, key=lambda x: x["ms"]):
                name = step_name(step)
                seen[name] = seen.get(name, 0) + 1
                rows.setdefault(name if seen[name] == 1 else f"{name} #{seen[name]}", []).append(step["ms"])
            at = {step_name(step): round(step["ms"], 2) for step in reversed(steps)}  # each step's first time
            collected = [{"at_ms": round((e["t"] - post) * 1000, 2), "ms": e["ms"], "pid": e["pid"]}
                         for e in events if e["event"] == "gc" and post <= e["t"] <= post + ttft]
            decode_pid = next((step["pid"] for step in steps if step["event"] == "decode.status"), None)
            streamed = [step["ms"] for step in steps if step["event"] == "server.stream_output"
                        and step["pid"] == decode_pid]
            each.append({"ttft_ms": round(ttft * 1000, 2), "waiting_ms": at.get("decode.status WaitingForInput"),
                         "success_ms": at.get("decode.status Success"),
                         "decode_streamed_ms": round(min(streamed), 2) if streamed else None, "gc": collected})
        medians = sorted(((statistics.median(ms), name, len(ms)) for name, ms in rows.items()))
        result[label] = {"samples": len(s.posted_at), "traced": len(each),
                         "steps": [{"median_ms": round(m, 2), "step": name, "samples": n} for m, name, n in medians],
                         "each": each}
    return result


async def traced_request(http, url: str, prompt: list[int], tokens: int, trace_dir: Path) -> dict:
    from kvbroker_tools.serving import client, trace

    before = {e["key"] for e in trace.read(trace_dir) if e["event"] == "decode.send_metadata"}
    post_t = time.time()
    answer = await client.generate(http, url, prompt, tokens)
    events = trace.read(trace_dir)
    rooms = [e["key"] for e in events if e["event"] == "decode.send_metadata" and e["key"] not in before]
    if len(rooms) != 1:
        return {"error": f"expected one new room in the trace, found {rooms}"}
    steps = timeline(events, post_t, rooms[0])
    steps.insert(0, {"ms": 0.0, "event": "router.post"})
    steps.append({"ms": round(answer.ttft_s * 1000, 2), "event": "client.first_token"})
    return {"room": rooms[0], "ttft_ms": round(answer.ttft_s * 1000, 2), "steps": sorted(steps, key=lambda s: s["ms"])}


async def run(args: argparse.Namespace) -> dict:
    import aiohttp

    from kvbroker_tools import threads
    from kvbroker_tools.serving import client, compare

    setup = model_setup(args.model)
    model, target = setup["path"], TARGETS[args.model]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbroker-serving-bench-"))
    trace_dir = log_dir / "trace"
    if args.trace:
        os.environ["KVBROKER_SERVING_TRACE"] = str(trace_dir)
    else:
        os.environ.pop("KVBROKER_SERVING_TRACE", None)
    labels = [f"kvbroker-{e}" for e in args.engines.split(",") if e] + ["mooncake"]
    prompts = client.prompts(args.requests, args.prompt_tokens, seed=2026)
    batch = client.prompts(args.batch, args.prompt_tokens, seed=2027)
    load_before = os.getloadavg()
    started_at, commit = time.time(), compare.git_commit()
    async with compare.deployments(model, log_dir, labels, prefill_args=setup["args"], decode_args=setup["args"],
                                   env=setup["env"]) as deployments, aiohttp.ClientSession() as http:
        urls = {label: d.url for label, d in deployments.items()}
        pausing = deployments if args.pause_others else None
        measuring = {label: d.processes() for label, d in deployments.items()}
        series = await compare.interleaved_ttft(http, urls, prompts, args.tokens, pausing=pausing,
                                                measuring=measuring)
        rates, timelines = {}, {}
        for label, url in urls.items():
            compare.only(pausing, label)
            rates[label] = await compare.throughput(http, url, batch, args.tokens)
            if label.startswith("kvbroker") and args.trace:
                timelines[label] = await traced_request(http, url, prompts[0], args.tokens, trace_dir)
    from kvbroker_tools.serving import trace

    medians = median_timeline(trace.read(trace_dir), series) if args.trace else {}
    same = all(series[label].answers == series["mooncake"].answers for label in labels)
    moon = series["mooncake"].median_ms
    ttft = {label: compare.ttft_summary(s) for label, s in series.items()}
    ratios = {label: round(series[label].median_ms / moon, 3) for label in labels if label != "mooncake"}
    return {
        "what": "TTFT and requests/s through SGLang 0.5.23 PD servers (router, prefill, decode): kvbroker "
                "beside SGLang's mooncake backend, same prompts, one run",
        "commit": commit, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at)),
        "machine": compare.machine(load_before),
        "model": {"name": args.model, "path": str(model), "shape": setup["shape"]},
        "workload": {"prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "ttft_requests": args.requests,
                     "batch": args.batch, "greedy": True, "stream": True},
        "timing": "TTFT: perf_counter from sending POST /generate to the router to the first streamed chunk with "
                  "a token; deployments interleaved request by request, two warm-up requests each first. "
                  "requests/s: the batch sent at once, wall time until the last answer. threads_per_request: "
                  "per TTFT request (from before its POST to its answer's last token), each process role's "
                  "threads' CPU and run-queue delay (/proc/<pid>/task/<tid>/schedstat), ms, by thread group.",
        "others_paused": args.pause_others,
        "traced": args.trace,
        "same_tokens_on_every_backend": same,
        "ttft": ttft,
        "ttft_median_ratio_vs_mooncake": ratios,
        "target": {"kvbroker median TTFT / mooncake's": f"<= {target}",
                   "met": {label: r <= target for label, r in ratios.items()}},
        "threads_per_request": {label: threads.per_request(s.threads, len(s.ttft_s)) for label, s in series.items()},
        "throughput": rates,
        "timeline": timelines,
        "timeline_medians": medians,
        "log_dir": str(log_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file (default: benchmarks/out/serving-<time>.json)")
    parser.add_argument("--engines", default="nixl", help="the brokers' engines to run, comma-separated")
    parser.add_argument("--requests", type=int, default=20, help="TTFT requests per deployment")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--batch", type=int, default=32, help="requests sent at once for requests/s")
    parser.add_argument("--model", default="llama", choices=sorted(TARGETS), help="the model the servers serve")
    parser.add_argument("--log-dir")
    parser.add_argument("--no-pause-others", dest="pause_others", action="store_false",
                        help="keep every deployment running while one is measured (by default the others are "
                             "SIGSTOPped: their idle schedulers spin and take the cores)")
    parser.add_argument("--no-trace", dest="trace", action="store_false",
                        help="no trace (its ~45 events per request cost every traced process CPU): the unbiased "
                             "TTFT ratio, without the timelines")
    args = parser.parse_args(argv)
    from kvbroker_tools.serving import compare

    result = compare.run_stopping_on_signals(run(args))
    stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
    out = Path(args.out or f"benchmarks/out/serving-{'' if args.model == 'llama' else args.model + '-'}{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for label, t in result["ttft"].items():
        rate = result["throughput"][label]
        print(f"{label:>18}: TTFT median {t['median_ms']:.1f} ms, p90 {t['p90_ms']:.1f} ms; "
              f"{rate['requests_per_s']:.2f} req/s ({rate['requests']} at once)")
    target = TARGETS[args.model]
    for label, ratio in result["ttft_median_ratio_vs_mooncake"].items():
        print(f"{label} / mooncake median TTFT ({args.model}): {ratio:.2f}x (target <= {target}x: "
              f"{'met' if ratio <= target else 'missed'})")
    for label, timeline_of in result["timeline_medians"].items():
        print(f"{label}: median ms from the router post over {timeline_of['traced']} of {timeline_of['samples']} "
              "TTFT samples")
        for step in timeline_of["steps"]:
            print(f"  {step['median_ms']:9.2f}  {step['step']}  (in {step['samples']})")
    print("per TTFT request, ms of CPU / of run-queue delay (threads), by process:")
    for label, roles in result["threads_per_request"].items():
        cells = [f"{role} {r['cpu_ms']:.1f}/{r['wait_ms']:.1f} ({r['threads']})" for role, r in roles.items()]
        print(f"  {label:>18}: " + ", ".join(cells))
    print(f"same tokens on every backend: {result['same_tokens_on_every_backend']}; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
