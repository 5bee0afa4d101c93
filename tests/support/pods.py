"""The rendered manifests as `podman kube play` runs them here (tests/deploy/test_pods.py): a role's
Deployment becomes one Pod of the CPU image, changed only where podman 4.3 or this machine lacks what a
cluster has, each change said here:
- native sidecars (an init container with restartPolicy: Always) are unknown to podman 4.3, which runs
  init containers to their end before the pod's others: the broker runs as the pod's first container;
- the broker's settings come from the rendered ConfigMap as literal variables, and what the downward API
  gives (the pod's name as broker id, its IP as the advertised host) as the pod's name and static IP;
- cert-manager's csi-driver writes the peer TLS files in a cluster; here a test CA's files, mounted;
- GPUs and RDMA NICs are not here: the containers' extended resources (and limits) are dropped;
- podman 4.3 makes an emptyDir a root-owned named volume, shared by name across pods: each emptyDir is
  a directory of the pod's own under `scratch` (the suite's private /dev/shm: memory, as medium Memory
  is), writable by the image's UID as fsGroup makes it in a cluster;
- podman publishes a containerPort on the host's port of that number: the pods reach each other on
  their own IPs, so the containers declare none;
- the inference server is tests/support/pod_server.py (with clients/examples) on the image's own Python.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import trustme

from tests.support.deploy import one

IMAGE = os.environ.get("KVBROKER_IMAGE", "localhost/kvbroker:cpu")
SERVER_DIR = Path(__file__).resolve().parent  # holds pod_server.py, mounted read-only in the server container
EXAMPLES_DIR = SERVER_DIR.parents[1] / "clients" / "examples"  # the cache pod_server.py uses


def identity(ca: trustme.CA, folder: Path, pod_name: str) -> None:
    """What csi-driver writes for the pod: its certificate (the pod's name and kvbroker-peer), key and CA,
    readable by the image's UID."""
    folder.mkdir(parents=True)
    cert = ca.issue_cert(pod_name, "kvbroker-peer")
    cert.cert_chain_pems[0].write_to_path(str(folder / "tls.crt"))
    cert.private_key_pem.write_to_path(str(folder / "tls.key"))
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))
    for path in (folder, *folder.iterdir()):
        os.chown(path, 10001, 10001)


def pod(docs: list[dict], *, name: str, ip: str, tls: Path, scratch: Path, server_env: dict[str, str]) -> dict:
    template = one(docs, "Deployment")["spec"]["template"]
    spec = copy.deepcopy(template["spec"])
    (broker,) = spec.pop("initContainers")
    broker.pop("restartPolicy")
    settings = one(docs, "ConfigMap")["data"]
    broker.pop("envFrom")
    literal = {e["name"]: e["value"] for e in broker.get("env", []) if "value" in e}
    broker["env"] = [{"name": k, "value": v} for k, v in
                     {**settings, **literal, "KVBROKER_BROKER_ID": name, "KVBROKER_ADVERTISE_HOST": ip}.items()]
    (server,) = spec["containers"]
    server["command"] = ["python", "/opt/pod-server/pod_server.py"]
    server["env"] = [*server.get("env", []), *({"name": k, "value": v} for k, v in server_env.items())]
    server.setdefault("volumeMounts", []).extend([
        {"name": "pod-server", "mountPath": "/opt/pod-server", "readOnly": True},
        {"name": "examples", "mountPath": "/opt/examples", "readOnly": True}])
    for container in (broker, server):
        container["image"] = IMAGE
        container.pop("resources", None)
        container.pop("ports", None)
    spec["containers"] = [broker, server]
    spec["restartPolicy"] = "Always"  # a container that dies comes back, as kubelet restarts a sidecar
    spec["volumes"] = [{"name": v["name"], "hostPath": {"path": str(tls), "type": "Directory"}}
                       if v["name"] == "peer-tls" else v for v in spec["volumes"]]
    spec["volumes"] += [{"name": "pod-server", "hostPath": {"path": str(SERVER_DIR), "type": "Directory"}},
                        {"name": "examples", "hostPath": {"path": str(EXAMPLES_DIR), "type": "Directory"}}]
    for volume in spec["volumes"]:
        if "emptyDir" in volume:
            del volume["emptyDir"]
            folder = scratch / name / volume["name"]
            folder.mkdir(parents=True)
            folder.chmod(0o1777)
            volume["hostPath"] = {"path": str(folder), "type": "Directory"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(template["metadata"].get("labels", {}))}, "spec": spec}
