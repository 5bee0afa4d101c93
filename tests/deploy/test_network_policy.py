"""The NetworkPolicy of each role: it fences the pod, admits only the other role's broker pods, on
exactly the peer port and, where the broker is written to, the transfer engines' data ports; and a
real broker, started with the manifests' settings, listens on nothing else."""

from __future__ import annotations

import pytest

from kvbroker.config import Settings
from tests.support.deploy import (
    OTHER_ROLE,
    broker,
    broker_settings,
    literal_env,
    lowered,
    one,
    peer_port,
    pod_labels,
    selects,
    without_rdma,
)
from tests.support.helpers import listeners

# Whether brokers of a role are written to, so that the other role's engines connect to theirs. A
# sender's engine only dials out (README.md, Security, Ports: SYNs seen across two namespaces).
WRITTEN_TO = {"decode": True, "prefill": False}
KERNEL_EPHEMERAL = range(32768, 61000)  # Linux's default ip_local_port_range, which Mooncake refuses


def policy(docs: list[dict]) -> dict:
    return one(docs, "NetworkPolicy")["spec"]


def data_ports(docs: list[dict]) -> range:
    """The engines' listening ports as the broker's data_port_range confines them, for both engines."""
    ports = Settings(**lowered(broker_settings(docs))).data_ports
    assert ports is not None, "KVBROKER_DATA_PORT_RANGE is not set: the engines would listen anywhere"
    return ports


def admitted(docs: list[dict]) -> set[tuple[str, int, int]]:
    """(protocol, first port, last port) of every port the policy opens."""
    found = set()
    for rule in policy(docs)["ingress"]:
        assert rule.get("ports"), "a rule without ports opens every port"
        for port in rule["ports"]:
            assert isinstance(port["port"], int), "a named port would not cover the engines' ports"
            found.add((port.get("protocol", "TCP"), port["port"], port.get("endPort", port["port"])))
    return found


def test_policy_fences_ingress_to_this_roles_pods_only(docs, role, rendered):
    spec = policy(docs)
    assert spec["policyTypes"] == ["Ingress"]
    assert selects(spec["podSelector"], pod_labels(docs))
    assert not selects(spec["podSelector"], pod_labels(rendered[OTHER_ROLE[role]]))
    assert not selects(spec["podSelector"], {"app.kubernetes.io/component": role})  # another app's pod


def test_policy_admits_only_the_other_roles_broker_pods_of_this_namespace(docs, role, rendered):
    other = pod_labels(rendered[OTHER_ROLE[role]])
    assert policy(docs)["ingress"], "no rule: the other role could not reach this broker at all"
    for rule in policy(docs)["ingress"]:
        (source,) = rule["from"]  # an empty or missing `from` admits every source
        assert set(source) == {"podSelector"}, "no namespaceSelector (other namespaces), no ipBlock"
        selector = source["podSelector"]
        assert selects(selector, other)
        assert not selects(selector, pod_labels(docs))
        assert not selects(selector, {"app.kubernetes.io/component": OTHER_ROLE[role]})  # not a kvbroker pod


def test_policy_opens_the_peer_port_and_to_a_written_broker_the_data_ports(docs, role):
    expected = {("TCP", peer_port(docs), peer_port(docs))}
    if WRITTEN_TO[role]:
        ports = data_ports(docs)
        expected.add(("TCP", ports.start, ports.stop - 1))
    assert admitted(docs) == expected


def test_data_port_range_is_one_both_engines_honour(docs):
    ports = data_ports(docs)
    assert 1024 <= ports.start and ports.stop - 1 <= 65535
    # Mooncake falls back to 15000-17000, which the policy does not open, for a range it refuses.
    assert not set(ports) & set(KERNEL_EPHEMERAL)
    assert peer_port(docs) not in ports


@pytest.mark.integration
async def test_a_broker_with_the_manifests_settings_listens_only_where_the_policy_opens(rendered, backend,
                                                                                         tmp_path):
    from kvbroker_tools.launch import start_broker

    docs = rendered["decode"]
    env = {key: value for key, value in broker_settings(docs).items() if not key.startswith("KVBROKER_PEER_TLS")}
    env.update(literal_env(broker(docs)), KVBROKER_BACKEND=backend, KVBROKER_METRICS_LISTEN="127.0.0.1:0",
               KVBROKER_LISTEN=f"unix:{tmp_path}/kvbroker.sock", KVBROKER_HEALTH_LISTEN=f"unix:{tmp_path}/health.sock")
    env = without_rdma(env)
    process = await start_broker("ports", "--listen", env["KVBROKER_LISTEN"], env=env)
    try:
        tcp, udp = listeners(process.pid, ("tcp", "tcp6")), listeners(process.pid, ("udp", "udp6"))
    finally:
        await process.stop()
    own = {int(process.peer_listen.rpartition(":")[2]), int(process.metrics_listen.rpartition(":")[2])}
    engines = tcp - own
    assert engines, "the engine opened no listener: the test would prove nothing"
    assert engines <= set(data_ports(docs)), f"engine ports outside the policy's range: {sorted(engines)}"
    assert own <= tcp and not udp
