"""Command line: `kvbroker serve | demo | bench | status | health`.

serve: runs one broker until SIGTERM/SIGINT (the first drains, a second forces an exit); prints
one JSON line on stdout when both listeners are bound, with their resolved addresses.
demo: two brokers in subprocesses, one MiniMax-M3-shaped request, every byte verified.
status: a running broker's engines, peers and counters (kvbroker/ops/status.py).
health: exit 0 if a broker reports SERVING (kvbroker/ops/probe.py; the image's HEALTHCHECK).
bench: the benchmark suite (kvbroker_tools.bench): a table on the terminal, JSON with --json / --out.

demo and bench are the tooling's (the kvbroker-tools distribution in tooling/, which a checkout's
scripts/setup.sh installs and the daemon's wheel and image do not carry). It is imported only inside
its command's branch, as SGLang's get_kv_class imports each backend; its arguments are declared here,
so that `kvbroker serve` loads neither the tooling nor numpy, and a daemon without it says so.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from kvbroker import __version__
from kvbroker.config import Settings, add_settings_arguments, settings_from_args
from kvbroker.ops import logs, probe, status


async def serve(settings: Settings) -> int:
    from kvbroker.ops.thread_names import named_pool
    from kvbroker.server import BrokerServer

    # asyncio's default pool, as many threads as asyncio's, named for the kernel (`top -H`, the bench)
    asyncio.get_running_loop().set_default_executor(named_pool(min(32, (os.cpu_count() or 1) + 4), "kvbroker-io"))

    def ready(endpoints) -> None:  # the line launch.py and operators wait for
        print(json.dumps({"event": "ready", "listen": endpoints.listen, "peer_listen": endpoints.peer_listen,
                          "peer_address": endpoints.peer_address, "metrics_listen": endpoints.metrics_listen,
                          "health_listen": endpoints.health_listen,
                          "broker_id": settings.broker_id, "pid": os.getpid()}), flush=True)

    return await BrokerServer(settings).serve(ready)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvbroker demo`'s arguments (tooling/src/kvbroker_tools/demo.py `run`)."""
    parser.add_argument("--preset", choices=["toy", "large"], default="toy")
    parser.add_argument("--backend", choices=["nixl", "mooncake"], default="nixl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvbroker bench`'s arguments (tooling/src/kvbroker_tools/bench.py `run`)."""
    parser.add_argument("--quick", action="store_true", help="small sizes, few iterations (under a minute)")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON report on stdout (the table goes to stderr)")
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    parser.add_argument("--backends", default="nixl,mooncake",
                        help="comma-separated transfer engines; those not installed are skipped")
    parser.add_argument("--sections", default="data,control,planner,registration",
                        help="comma-separated subset of data,control,planner,registration")
    parser.add_argument("--sizes", metavar="MIB,...",
                        help="data-plane request sizes in MiB, comma-separated (overrides the plan)")
    parser.add_argument("--repeats", type=int, help="timed runs per data-plane case (median reported)")
    parser.add_argument("--seed", type=int, default=0)


def setting_errors(exc: ValidationError) -> str:
    """Pydantic's refusal of the settings as one line per setting: its flag, its variable, the rule."""
    lines = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        where = f"--{name.replace('_', '-')} / KVBROKER_{name.upper()}" if error["loc"] else "settings"
        lines.append(f"{name} ({where}): {error['msg']}, got {error.get('input')!r}")
    return "; ".join(lines)


def _run(coro) -> int:
    import uvloop

    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbroker", description="KV-cache transfer broker")
    parser.add_argument("--version", action="version", version=f"kvbroker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="run a broker")
    add_settings_arguments(serve_cmd)
    _demo_arguments(commands.add_parser("demo", help="move a MiniMax-M3-shaped request between two brokers"))
    status.add_arguments(commands.add_parser("status", help="show a running broker's engines, peers and counters"))
    probe.add_arguments(commands.add_parser("health", help="exit 0 if a broker's grpc.health.v1 says SERVING"))
    _bench_arguments(commands.add_parser("bench", help="measure data and control plane, planner, registration"))
    args = parser.parse_args(argv)

    if args.command == "serve":
        try:
            settings = settings_from_args(args)
        except ValidationError as exc:
            serve_cmd.exit(2, f"kvbroker serve: error: {setting_errors(exc)}\n")  # as argparse for a bad flag
        logs.configure(settings.log_level, settings.log_format)
        code = _run(serve(settings))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # engine libraries may crash in their own teardown after a clean shutdown
    if args.command in ("demo", "bench"):
        if importlib.util.find_spec("kvbroker_tools") is None:
            print(f"kvbroker {args.command}: needs the kvbroker-tools package, which this installation does not have "
                  "(from a checkout: bash scripts/setup.sh, or pip install -e tooling)", file=sys.stderr)
            return 2
        tool = importlib.import_module(f"kvbroker_tools.{args.command}")
        logs.configure("WARNING", "text")
        if args.command == "demo":
            return _run(tool.run(args.preset, args.backend, args.seed, args.json))
        return _run(tool.run(args))
    if args.command == "status":
        return status.run(args)
    if args.command == "health":
        return probe.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
