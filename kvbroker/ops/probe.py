"""Health probe: asks a broker's grpc.health.v1 service whether it is SERVING.

Callers: the container image's HEALTHCHECK (`python -m kvbroker.ops.probe`), exec probes, operators.
`check` is the probe itself; `add_arguments` and `run` are the `kvbroker health` subcommand, ready to
be wired into cli.py. By default it checks the health listener when one is configured (the
`health_listen` setting, KVBROKER_HEALTH_LISTEN in a container: answered from threads of its own,
so a busy peer flood does not delay it), else the local API at the address `serve` would bind (the
`listen` setting, KVBROKER_LISTEN); exit 0 when SERVING, 1 otherwise, with one line on stdout (the
status) or stderr (why the check failed).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.config import Settings


def check(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The serving status name of `service` ("" is the whole server) at `address` (host:port or unix:/path).

    Raises grpc.RpcError when the broker is unreachable, does not answer within `timeout_s`, or does
    not know `service` (NOT_FOUND).
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def default_address(s: Settings) -> str:
    """What the probe asks when no address is given: the health listener, else the local API."""
    return s.health_listen or s.listen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="broker to check: host:port or unix:/path [default: the health_listen setting, "
                             "else the listen setting]")
    parser.add_argument("--service", default="",
                        help="service to check, e.g. kvbroker.v1.PeerService [default: the whole server]")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")


def run(args: argparse.Namespace) -> int:
    address = args.address or default_address(Settings())
    try:
        status = check(address, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"health check of {address} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbroker health", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
