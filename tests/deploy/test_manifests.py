"""The Kubernetes manifests as kustomize renders them: valid against the Kubernetes schemas (offline,
strict), and holding the sidecar contract of DESIGN.md. Each test runs for both roles."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from kvbroker.config import Settings
from kvbroker.probe import check
from kvbroker.server import PEER_SERVICE
from tests.deploy.conftest import (
    OVERLAYS,
    broker,
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


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(docs, version):
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_broker_is_a_native_sidecar(docs):
    assert broker(docs)["restartPolicy"] == "Always"
    assert "kvbroker" not in [c["name"] for c in pod_spec(docs)["containers"]]


def test_probes_ask_the_health_service_on_the_peer_port(docs):
    container = broker(docs)
    assert {p["containerPort"] for p in container["ports"] if p["name"] == "peer"} == {peer_port(docs)}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = container[kind]["grpc"]
        assert grpc["port"] == peer_port(docs), kind
        assert grpc.get("service", "") in ("", PEER_SERVICE), kind


def test_liveness_outlasts_the_drain_and_the_grace_period_covers_it(docs):
    spec, probe = pod_spec(docs), broker(docs)["livenessProbe"]
    drain = Settings(**lowered(settings(docs))).shutdown_grace_s
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


def test_peer_tls_secret_is_mounted_read_only_in_the_broker(docs):
    (mount,) = [m for m in broker(docs)["volumeMounts"] if m["mountPath"] == "/etc/kvbroker/tls"]
    assert mount["readOnly"] is True
    assert volume(docs, "/etc/kvbroker/tls", broker(docs))["secret"]["secretName"]


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
    data = settings(docs)
    assert all(key.startswith("KVBROKER_") and key.removeprefix("KVBROKER_").lower() in Settings.model_fields
               for key in data), "pydantic-settings ignores an unknown KVBROKER_ variable silently"
    Settings(**lowered(data))
    for entry in broker(docs)["env"]:
        assert entry["name"].removeprefix("KVBROKER_").lower() in Settings.model_fields, entry["name"]


@pytest.mark.integration
async def test_a_broker_with_these_settings_answers_the_probes_as_kubelet_asks(docs, tmp_path):
    from kvbroker.launch import start_broker

    env = {**settings(docs), "KVBROKER_LISTEN": f"unix:{tmp_path}/kvbroker.sock"}
    process = await start_broker("probes", "--listen", env["KVBROKER_LISTEN"], env=env)
    try:
        port = process.peer_listen.rpartition(":")[2]
        answers = {kind: check(f"127.0.0.1:{port}", broker(docs)[kind]["grpc"].get("service", ""))
                   for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    finally:
        await process.stop()
    assert set(answers.values()) == {"SERVING"}
