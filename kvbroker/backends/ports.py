"""The transfer engines' data ports: the environment that keeps their listeners in data_port_range.

Both engines read their listening ports from the environment only: UCX (NIXL) when the agent is
constructed, Mooncake once per process, when `mooncake.engine` is first imported.
- `ucx_environment(ports, host)`: UCX_TCP_PORT_RANGE, and UCX_NET_DEVICES: the interface holding
  the advertised host's address (`interface_of`) plus every RDMA port (`rdma_ports`, UCX's names,
  e.g. mlx5_0:1), so that UCX listens on no other interface;
- `mooncake_environment(ports)`: MC_MIN_RPC_PORT and MC_MAX_RPC_PORT (Mooncake binds 0.0.0.0 and
  [::] whatever it is told: only the port can be narrowed);
- `environment(values)`: sets the variables the operator did not set for the duration of a with
  block, and puts the environment back after.
Used by nixl.py and mooncake.py at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
INFINIBAND = Path("/sys/class/infiniband")
IF_INET6 = Path("/proc/net/if_inet6")
_environment = threading.Lock()  # the environment is the process's: one change at a time


def ucx_environment(ports: range, host: str) -> dict[str, str]:
    """What UCX needs to listen only in `ports`, and only where peers reach this broker."""
    values = {"UCX_TCP_PORT_RANGE": f"{ports.start}-{ports.stop - 1}"}
    devices = [name for name in [interface_of(host)] if name] + rdma_ports()
    if devices:
        values["UCX_NET_DEVICES"] = ",".join(devices)
    else:
        log.warning("the advertised host %r is on no interface of this host and no RDMA port was found: "
                    "UCX listens on every interface", host)
    return values


def mooncake_environment(ports: range) -> dict[str, str]:
    return {"MC_MIN_RPC_PORT": str(ports.start), "MC_MAX_RPC_PORT": str(ports.stop - 1)}


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Inside: each of `values` that the environment does not set already; yields those it set."""
    with _environment:
        added = {key: value for key, value in values.items() if key not in os.environ}
        os.environ.update(added)
        try:
            yield added
        finally:
            for key in added:
                os.environ.pop(key, None)


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds `host`'s address (`host` resolved when it is a
    name); None when no interface holds it."""
    wanted = set(_addresses(host))
    for name, address in interface_addresses():
        if address in wanted:
            return name
    return None


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(interface, address) for each IPv4 address (SIOCGIFADDR) and each IPv6 one (/proc/net/if_inet6)."""
    found: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            found.append((name, ipaddress.IPv4Address(answer[20:24])))
    with contextlib.suppress(OSError):
        for line in IF_INET6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                found.append((fields[5], ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def rdma_ports(root: Path = INFINIBAND) -> list[str]:
    """Every RDMA port of the host as UCX names it: device:port, e.g. mlx5_0:1."""
    if not root.is_dir():
        return []
    return sorted(f"{port.parent.parent.name}:{port.name}" for port in root.glob("*/ports/*"))


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    # A sockaddr's host is a str; only a Python built without IPv6 gives AF_INET6's as (int, bytes).
    hosts = [info[4][0] for info in infos]
    return [ipaddress.ip_address(h.partition("%")[0]) for h in hosts if isinstance(h, str)]
