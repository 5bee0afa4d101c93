"""`bash scripts/demo.sh --vllm`: vLLM's real PD deployment with kvbroker's connector, one prompt, its answer
beside a non-PD vLLM server's and the time to first token of both.

Builds the tiny Llama and its tokenizer locally (kvbroker_tools.serving.models), starts a non-PD vLLM
0.32 server and vllm-router over a prefill and a decode server with kvbroker's connector
(`--kv-transfer-config '{"kv_connector": "KvbrokerConnector", "kv_connector_module_path":
"kvbroker_vllm", ...}'`) and a broker beside each (NIXL; `--engine mooncake` for Mooncake's), sends
both the same prompt (greedy, streamed) and prints both answers, whether their tokens agree, how many
prompt tokens decode received by transfer, and the median time to first token of a few repeats.
Start-up takes a few minutes on 2 cores.
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

    from kvbroker_tools.serving import compare, models, vllm_stack

    model = models.llama()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt = tokenizer.encode(args.prompt).ids
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbroker-vllm-demo-"))
    print(f"model {model} (random weights); logs in {log_dir}", flush=True)
    print(f"starting a non-PD vLLM server, and vllm-router over a prefill and a decode server with kvbroker's "
          f"connector ({args.engine})", flush=True)
    reference = await vllm_stack.start_reference(model, log_dir / "non-pd")
    try:
        pd = await vllm_stack.start_kvbroker_pd(model, log_dir / "kvbroker", args.engine)
        try:
            async with aiohttp.ClientSession() as http:
                before = await vllm_stack.prompt_token_sources(http, pd.servers["decode"].url)

                async def ask(session, url, ids, tokens):
                    return await vllm_stack.complete(session, url, ids, tokens)

                series = await compare.interleaved_ttft(http, {"non-pd": reference.url, "kvbroker": pd.url},
                                                        [prompt] * args.repeats, args.tokens, warmup=1, ask=ask)
                after = await vllm_stack.prompt_token_sources(http, pd.servers["decode"].url)
        finally:
            await pd.stop()
    finally:
        await reference.stop()
    print(f"\nprompt ({len(prompt)} tokens): {args.prompt!r}")
    for label, s in series.items():
        print(f"\n{label:>10}: {tokenizer.decode(s.answers[-1])!r}")
        print(f"{'':>10}  time to first token {s.median_ms:.1f} ms (median of {len(s.ttft_s)})")
    moved = int(after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0))
    same = len({tuple(s.answers[-1]) for s in series.values()}) == 1
    print(f"\nsame tokens: {same}; decode received {moved} prompt tokens by transfer "
          f"({args.repeats} x {len(prompt)} asked); kvbroker / non-PD median TTFT: "
          f"{series['kvbroker'].median_ms / series['non-pd'].median_ms:.2f}x")
    if args.json:
        print(json.dumps({label: {"ttft_ms": [round(t * 1000, 2) for t in s.ttft_s], "answer": s.answers[-1]}
                          for label, s in series.items()}))
    return 0 if same and moved > 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbroker_tools.serving.vllm_demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["nixl", "mooncake"], default="nixl", help="the brokers' transfer engine")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate (greedy)")
    parser.add_argument("--repeats", type=int, default=5, help="requests per deployment for the median TTFT")
    parser.add_argument("--log-dir", help="where the servers log (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    from kvbroker_tools.serving import compare

    return compare.run_stopping_on_signals(run(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
