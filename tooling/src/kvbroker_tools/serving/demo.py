"""`bash scripts/demo.sh --sglang`: the real PD deployment with kvbroker, one request, its answer and its
time to first token beside SGLang's own mooncake backend, in the same run.

Builds the tiny Llama and its tokenizer locally (kvbroker_tools.serving.models), starts SGLang 0.5.23's
router over a prefill and a decode server with `--disaggregation-transfer-backend kvbroker` and a
kvbroker broker per server (NIXL), then the same with `--disaggregation-transfer-backend mooncake`,
sends each the same prompt (greedy, streamed) and prints both answers, whether their tokens agree,
and the median time to first token of a few repeats. Start-up takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

PROMPT = "def read_config(path):\n    \"\"\"Read the configuration file at path and return"


async def run(args: argparse.Namespace) -> int:
    import aiohttp
    from tokenizers import Tokenizer

    from kvbroker_tools.serving import compare, models

    model = models.llama()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))  # the servers' own tokenizer, without transformers
    prompt = tokenizer.encode(args.prompt).ids
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbroker-sglang-demo-"))
    labels = [f"kvbroker-{args.engine}", "mooncake"]
    print(f"model {model} (random weights); logs in {log_dir}", flush=True)
    print("starting SGLang's router, a prefill and a decode server for: " + ", ".join(labels), flush=True)
    async with compare.deployments(model, log_dir, labels) as started, aiohttp.ClientSession() as http:
        series = await compare.interleaved_ttft(http, {k: v.url for k, v in started.items()},
                                                [prompt] * args.repeats, args.tokens, warmup=1)
    print(f"\nprompt ({len(prompt)} tokens): {args.prompt!r}")
    for label, s in series.items():
        print(f"\n{label:>18}: {tokenizer.decode(s.answers[-1])!r}")
        print(f"{'':>18}  time to first token {s.median_ms:.1f} ms (median of {len(s.ttft_s)})")
    same = len({tuple(s.answers[-1]) for s in series.values()}) == 1
    kvb, moon = (series[label].median_ms for label in labels)
    print(f"\nsame tokens on both backends: {same}; kvbroker / mooncake median TTFT: {kvb / moon:.2f}x")
    if args.json:
        print(json.dumps({label: {"ttft_ms": [round(t * 1000, 2) for t in s.ttft_s], "answer": s.answers[-1]}
                          for label, s in series.items()}))
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbroker_tools.serving.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["nixl", "mooncake"], default="nixl", help="the brokers' transfer engine")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate (greedy)")
    parser.add_argument("--repeats", type=int, default=5, help="requests per backend for the median TTFT")
    parser.add_argument("--log-dir", help="where the servers log (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    from kvbroker_tools.serving import compare

    return compare.run_stopping_on_signals(run(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
