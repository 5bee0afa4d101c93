"""The Kubernetes manifests as kustomize renders them: valid against the Kubernetes schemas (offline,
strict), and holding the sidecar contract of DESIGN.md. Each test runs for both roles."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from kvbroker.config import Settings
from kvbroker.server import BROKER_SERVICE
from tests.support.deploy import (
    OVERLAYS,
    PENDING_SETTINGS,
    broker,
    broker_settings,
    dockerfile_instructions,
    lowered,
    one,
    peer_port,
    pod_spec,
    server,
    settings,
    volume,
)

# 1.29: the first release with native sidecars on by default; and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
EXTENDED = re.compile(r"^(nvidia\.com/gpu|rdma/.+)$")
# The probe the image's HEALTHCHECK runs: `python -m kvbroker.ops.probe`, on the image's PATH.
PROBE = next(i for i in dockerfile_instructions() if i.keyword == "HEALTHCHECK").exec_form()[:3]
# Variables the transfer engines read, which the broker sets from KVBROKER_DATA_PORT_RANGE: set in a
# container, they would override it.
ENGINE_VARIABLES = {"UCX_TCP_PORT_RANGE", "UCX_NET_DEVICES", "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"}
# Engine variables the broker's container sets and the broker reads itself: UCX_TLS, which its
# start-up check of the data plane holds to protected transports (kvbroker/backends/transports.py).
BROKER_READ_ENGINE_VARIABLES = {"UCX_TLS"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(docs, version):
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
                                         "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_broker_is_a_native_sidecar(docs):
    assert broker(docs)["restartPolicy"] == "Always"
    assert "kvbroker" not in [c["name"] for c in pod_spec(docs)["containers"]]


def test_probes_exec_the_health_probe_against_the_local_api(docs):
    container = broker(docs)
    assert {p["containerPort"] for p in container["ports"] if p["name"] == "peer"} == {peer_port(docs)}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        # Only exec: kubelet's grpc, httpGet and tcpSocket probes cannot speak TLS to the peer port.
        assert set(container[kind]) - {"periodSeconds", "timeoutSeconds", "failureThreshold"} == {"exec"}, kind
        command = container[kind]["exec"]["command"]
        assert command[:3] == PROBE and "--address" not in command, kind  # the listen setting's socket
        assert command[3:] in ([], ["--service", BROKER_SERVICE]), kind
        assert container[kind]["timeoutSeconds"] > 2, kind  # the probe's own timeout, plus Python's start


def test_liveness_outlasts_the_drain_and_the_grace_period_covers_it(docs):
    spec, probe = pod_spec(docs), broker(docs)["livenessProbe"]
    drain = Settings(**lowered(broker_settings(docs))).shutdown_grace_s
    assert probe["periodSeconds"] * probe["failureThreshold"] > drain
    assert spec["terminationGracePeriodSeconds"] > drain


def test_dev_shm_is_one_memory_volume_shared_by_both_containers(docs):
    volumes = [volume(docs, "/dev/shm", c) for c in (broker(docs), server(docs))]
    assert volumes[0] is volumes[1]
    assert volumes[0]["emptyDir"]["medium"] == "Memory"


def test_local_api_is_a_unix_socket_in_a_volume_both_containers_mount(docs):
    listen = settings(docs)["KVBROKER_LISTEN"]
    assert listen.startswith("unix:/")
    folder = listen.removeprefix("unix:").rpartition("/")[0]
    volumes = [volume(docs, folder, c) for c in (broker(docs), server(docs))]
    assert volumes[0] is volumes[1] and "emptyDir" in volumes[0]
    assert {"name": "KVBROKER_ADDRESS", "value": listen} in server(docs)["env"]


def test_pod_shares_its_process_namespace(docs):
    assert pod_spec(docs)["shareProcessNamespace"] is True


def test_broker_may_lock_memory_and_nothing_else(docs):
    context = broker(docs)["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert context["allowPrivilegeEscalation"] is False


def test_pod_runs_as_the_image_user(docs):
    user = [i for i in dockerfile_instructions() if i.keyword == "USER"][-1].args.split(":")[0]
    context = pod_spec(docs)["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == int(user)


def test_gpus_go_to_the_server_and_the_rdma_nic_to_the_broker(docs):
    assert "nvidia.com/gpu" in server(docs)["resources"]["limits"]
    assert any(name.startswith("rdma/") for name in broker(docs)["resources"]["limits"])


def test_every_container_has_requests_and_limits_and_extended_resources_match(docs):
    for container in (broker(docs), server(docs)):
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert {"cpu", "memory"} <= set(requests) and "memory" in limits, container["name"]
        extended = {k for k in {*requests, *limits} if EXTENDED.match(k)}
        assert all(requests.get(k) == limits.get(k) for k in extended), container["name"]


def test_peer_service_is_headless_and_targets_the_peer_port(docs):
    service = one(docs, "Service")["spec"]
    assert service["clusterIP"] == "None"
    (port,) = service["ports"]
    assert port["port"] == peer_port(docs) and port["targetPort"] == "peer"


def test_service_and_pdb_select_exactly_this_roles_pods(docs, role):
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selectors = (one(docs, "Service")["spec"]["selector"],
                 one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                 one(docs, "Deployment")["spec"]["selector"]["matchLabels"])
    for selector in selectors:
        assert selector.items() <= labels.items() and selector["app.kubernetes.io/component"] == role


def test_roles_do_not_collide(rendered):
    names = [(d["kind"], d["metadata"]["name"]) for role in OVERLAYS for d in rendered[role]]
    assert len(names) == len(set(names))
    modes = {role: {e["name"]: e.get("value") for e in server(rendered[role])["env"]}["DISAGGREGATION_MODE"]
             for role in OVERLAYS}
    assert modes == {role: role for role in OVERLAYS}


def test_config_map_holds_valid_broker_settings_only(docs):
    data = broker_settings(docs)
    assert all(key.startswith("KVBROKER_") and key.removeprefix("KVBROKER_").lower() in Settings.model_fields
               for key in data), "pydantic-settings ignores an unknown KVBROKER_ variable silently"
    Settings(**lowered(data))
    for entry in broker(docs)["env"]:
        if entry["name"] not in BROKER_READ_ENGINE_VARIABLES:
            assert entry["name"].removeprefix("KVBROKER_").lower() in Settings.model_fields, entry["name"]


def test_pending_settings_are_not_settings_yet(rendered):
    """When the broker gains one, this fails: drop it from PENDING_SETTINGS, so that it is validated."""
    carried = {key for role in OVERLAYS for key in settings(rendered[role])}
    for key in PENDING_SETTINGS:
        assert key.removeprefix("KVBROKER_").lower() not in Settings.model_fields, f"{key} exists now"
        assert key in carried, f"{key} is pending but no manifest carries it"


def test_the_engines_variables_come_from_the_data_port_range_only(docs):
    assert broker_settings(docs).get("KVBROKER_DATA_PORT_RANGE")
    for container in (broker(docs), server(docs)):
        assert not ENGINE_VARIABLES & {e["name"] for e in container.get("env", [])}, container["name"]
