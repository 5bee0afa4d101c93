"""data_port_range on a real broker, for both engines: the engine listens only in the range, and the
broker sets the engine's variables itself, UCX_NET_DEVICES from the advertised host included."""

from __future__ import annotations

import json

import pytest

from tests.support.brokers import close_broker, open_broker
from tests.support.helpers import listeners

pytestmark = pytest.mark.integration

RANGE = range(20100, 20120)


async def test_the_engine_listens_only_in_the_data_port_range(backend):
    broker = await open_broker(f"ports-{backend}", backend, "--data-port-range", f"{RANGE.start}-{RANGE.stop - 1}",
                               "--log-level", "INFO", "--log-format", "json",
                               prefix=("env", "-u", "UCX_NET_DEVICES"))  # the broker picks it
    try:
        tcp = listeners(broker.process.pid, ("tcp", "tcp6"))
    finally:
        assert await close_broker(broker) == 0
    engine = tcp - {int(broker.peer_address.rpartition(":")[2]), int(broker.process.listen.rpartition(":")[2])}
    assert engine and engine <= set(RANGE), sorted(engine)
    lines = [json.loads(line) for line in broker.process.stderr_lines if line.startswith("{")]
    if backend == "nixl":
        (confined,) = [e for e in lines if e["msg"] == "NIXL agent's UCX listeners confined"]
        assert confined["applied"]["UCX_TCP_PORT_RANGE"] == "20100-20119"
        assert confined["applied"]["UCX_NET_DEVICES"].split(",")[0] == "lo"  # the advertised 127.0.0.1's
    else:
        said = [e for e in lines if e["msg"].startswith("Mooncake listens on every interface")]
        assert len(said) == 1 and said[0]["applied"] == {"MC_MIN_RPC_PORT": "20100", "MC_MAX_RPC_PORT": "20119"}
