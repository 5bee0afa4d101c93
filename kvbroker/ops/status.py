"""`kvbroker status`: what a running broker holds, from its GetBrokerInfo and grpc.health.v1 Health.

`query` asks a broker (by default at the `listen` setting, so KVBROKER_LISTEN) and returns a plain
dict, the shape `--json` prints; `render` turns that dict into the tables a terminal shows: the
broker, its engines with their components, its open sessions, its peers and its request counters. `add_arguments` and
`run` are the subcommand, wired in cli.py. Exit 0 when the broker answered, 1 when it did not.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.config import Settings

if TYPE_CHECKING:
    from kvbroker_client.v1 import broker_service_pb2 as bpb

STATES = ("PENDING", "TRANSFERRING", "SUCCEEDED", "FAILED")


def _enum(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix) if value in enum.values() else str(value)


def _engine(e: bpb.EngineInfo) -> dict:
    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import common_pb2 as pb

    t = e.topology
    return {
        "engine_id": e.engine_id,
        "topology": {name: getattr(t, name) for name in ("tp_size", "tp_rank", "attn_tp_size", "attn_tp_rank",
                                                         "pp_size", "pp_rank", "dp_rank", "page_size",
                                                         "start_layer", "end_layer")}
                    | {"kv_dtype": _enum(pb.KvDtype, t.kv_dtype, "KV_DTYPE_")},
        "components": [{"component": _enum(pb.Component, c.component, "COMPONENT_"),
                        "layout": _enum(pb.Layout, c.layout, "LAYOUT_"),
                        "num_pages": c.num_pages,
                        "layer_buffers": len(c.layer_buffers),
                        "bytes": sum(b.length for b in c.layer_buffers)} for c in e.components],
        "registered_bytes": e.registered_bytes,
        "memory_ownership": _enum(bpb.MemoryOwnership, e.memory_ownership, "MEMORY_OWNERSHIP_"),
        "session_id": e.session_id,
    }


def query(address: str, timeout_s: float = 5.0) -> dict:
    """The broker at `address` as a dict; raises grpc.RpcError when it does not answer GetBrokerInfo."""
    # The stubs on use: importing kvbroker_client loads its client and numpy, which the CLI's
    # argument parser (built for every command, `serve` included) has no need of.
    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

    with grpc.insecure_channel(address) as channel:
        info = bpb_grpc.BrokerServiceStub(channel).GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=timeout_s)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            health = f"unknown ({exc.code().name})"
    counts = dict(info.request_counts)
    return {
        "address": address,
        "health": health,
        "broker_id": info.broker_id,
        "epoch": info.epoch,
        "version": info.version,
        "backend": info.backend,
        "peer_address": info.peer_address,
        "peers_authenticated": info.peers_authenticated,
        "warnings": [] if info.peers_authenticated else [UNAUTHENTICATED_WARNING],
        "peer_allow": list(info.peer_allow),
        "data_port_range": info.data_port_range,
        "data_port_unprotected": info.data_port_unprotected,
        "engines": [_engine(e) for e in info.engines],
        "peers": [{"address": p.address, "broker_id": p.broker_id, "epoch": p.epoch, "handshakes": p.handshakes}
                  for p in info.peers],
        "request_counts": {state: counts.pop(state, 0) for state in STATES} | counts,
        "sessions": [{"session_id": x.session_id, "holder": x.holder, "engine_ids": list(x.engine_ids),
                      "opened": _utc(x.opened_unix_ms)} for x in info.sessions],
    }


UNAUTHENTICATED_WARNING = ("no mutual TLS on the peer port: any host that reaches it may offer, squat request "
                           "ids, act as a confused deputy and, with a sniffed token, complete or revoke grants "
                           "(README, Security)")


def _utc(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _table(headers: list[str], rows: list[list[object]]) -> list[str]:
    cells = [headers] + [[f"{v:,}" if isinstance(v, int) else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def render(status: dict) -> str:
    lines = [f"broker        {status['broker_id']} (kvbroker {status['version']}, {status['backend']}, "
             f"epoch {status['epoch']})",
             f"health        {status['health']} at {status['address']}",
             f"peer address  {status['peer_address']}",
             f"peers         {'authenticated (mutual TLS)' if status['peers_authenticated'] else 'NOT authenticated'}"
             f", admitting {', '.join(status['peer_allow']) or '*'}",
             f"data ports    {status['data_port_range'] or 'OPEN TO ALL (data_port_range unset): fence them'}"
             + (f"; UNPROTECTED: {status['data_port_unprotected']}" if status["data_port_unprotected"] else "")]
    if not status["peers_authenticated"]:
        lines.append(f"WARNING       {UNAUTHENTICATED_WARNING}")
    lines.append("")
    rows = []
    for e in status["engines"]:
        t = e["topology"]
        first = [e["engine_id"], f"{t['tp_rank']}/{t['tp_size']}", f"{t['attn_tp_rank']}/{t['attn_tp_size']}",
                 f"{t['pp_rank']}/{t['pp_size']}", t["dp_rank"], f"{t['start_layer']}-{t['end_layer'] - 1}",
                 t["page_size"], t["kv_dtype"]]
        for i, c in enumerate(e["components"]):
            rows.append((first if i == 0 else [""] * len(first))
                        + [c["component"], c["layout"], c["num_pages"], c["layer_buffers"], c["bytes"]])
    lines += _table(["ENGINE", "TP", "ATTN_TP", "PP", "DP", "LAYERS", "PAGE", "DTYPE", "COMPONENT", "LAYOUT",
                     "PAGES", "BUFFERS", "BYTES"], rows) if rows else ["no engines registered"]
    lines.append("")
    sessions = [[x["session_id"], x["holder"] or "-", ", ".join(x["engine_ids"]) or "-", x["opened"]]
                for x in status["sessions"]]
    lines += _table(["SESSION", "HOLDER", "ENGINES", "OPENED"], sessions) if sessions else ["no open sessions"]
    lines.append("")
    peers = [[p["address"], p["broker_id"], str(p["epoch"]), p["handshakes"]] for p in status["peers"]]
    lines += _table(["PEER", "BROKER", "EPOCH", "HANDSHAKES"], peers) if peers else ["no peers yet"]
    lines.append("")
    lines += _table(["REQUESTS", "COUNT"], [[state, n] for state, n in status["request_counts"].items()])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="broker's local API: host:port or unix:/path [default: the listen setting]")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    address = args.address or Settings().listen
    try:
        status = query(address, args.timeout)
    except grpc.RpcError as exc:
        print(f"kvbroker status: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0
