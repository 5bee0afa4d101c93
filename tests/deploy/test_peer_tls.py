"""Peer TLS in the manifests: a certificate per pod from cert-manager's csi-driver, whose files are
where the KVBROKER_PEER_TLS_* settings point and whose SANs are the broker id and the server name
brokers verify; the namespace's CA (deploy/cert-manager), checked field by field since the offline
schemas lack cert-manager's CRDs; and a broker started with these settings and certificates shaped
like the driver's, which serves mutual TLS, transfers, and answers the exec probes."""

from __future__ import annotations

import os
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

import grpc
import pytest
import trustme

from kvbroker.ops.probe import check
from tests.support.deploy import OTHER_ROLE, broker, literal_env, one, pod_spec, server, settings, volume, without_rdma

TLS_FILES = {"KVBROKER_PEER_TLS_CERT": "certificate-file", "KVBROKER_PEER_TLS_KEY": "privatekey-file",
             "KVBROKER_PEER_TLS_CA": "ca-file"}
DRIVER_FILES = {"certificate-file": "tls.crt", "privatekey-file": "tls.key", "ca-file": "ca.crt"}  # its defaults
# csi-driver's volume attributes (pkg/apis/v1alpha1): a misspelt one is ignored, not refused.
DRIVER_ATTRIBUTES = {
    "issuer-name", "issuer-kind", "issuer-group", "literal-subject", "common-name", "organizations",
    "organizationalunits", "countries", "provinces", "localities", "streetaddresses", "postalcodes", "serialnumber",
    "dns-names", "ip-sans", "uri-sans", "duration", "is-ca", "key-usages", "key-algorithm", "key-encoding",
    "key-size", "ca-file", "certificate-file", "privatekey-file", "fs-group", "renew-before", "reuse-private-key",
    "pkcs12-enable", "pkcs12-filename", "pkcs12-password",
}
# The fields of cert-manager.io/v1 that deploy/cert-manager may use, per kind (a subset of the API).
CERT_MANAGER_SPEC = {
    "Issuer": {"selfSigned", "ca"},
    "Certificate": {"isCA", "commonName", "secretName", "duration", "renewBefore", "privateKey", "issuerRef",
                    "dnsNames", "usages", "subject"},
}


def tls_volume(docs: list[dict]) -> dict:
    folders = {str(PurePosixPath(settings(docs)[key]).parent) for key in TLS_FILES}
    assert len(folders) == 1, f"the TLS files are in one volume: {folders}"
    return volume(docs, folders.pop(), broker(docs))


def attributes(docs: list[dict]) -> dict[str, str]:
    """The csi-driver volume's attributes without their csi.cert-manager.io/ prefix."""
    found = tls_volume(docs)["csi"]["volumeAttributes"]
    assert all(key.startswith("csi.cert-manager.io/") for key in found)
    return {key.removeprefix("csi.cert-manager.io/"): value for key, value in found.items()}


def listed(value: str) -> list[str]:
    return [item.strip() for item in value.split(",")]


def test_tls_files_are_the_per_pod_csi_volume_mounted_read_only_in_the_broker_only(docs):
    source = tls_volume(docs)
    assert source["csi"]["driver"] == "csi.cert-manager.io" and source["csi"]["readOnly"] is True
    folder = str(PurePosixPath(settings(docs)["KVBROKER_PEER_TLS_CERT"]).parent)
    (mount,) = [m for m in broker(docs)["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True
    assert source["name"] not in [m["name"] for m in server(docs)["volumeMounts"]], "the key stays in the broker"


def test_each_tls_setting_names_the_file_the_driver_writes(docs):
    attrs = attributes(docs)
    assert set(attrs) <= DRIVER_ATTRIBUTES, set(attrs) - DRIVER_ATTRIBUTES
    for key, attribute in TLS_FILES.items():
        assert PurePosixPath(settings(docs)[key]).name == attrs.get(attribute, DRIVER_FILES[attribute]), key


def test_certificate_names_the_broker_id_and_the_verified_server_name(docs):
    attrs = attributes(docs)
    names = listed(attrs["dns-names"])
    # The identity is the pod's name: the driver expands ${POD_NAME}, the broker id is metadata.name.
    assert "${POD_NAME}" in names
    (broker_id,) = [e for e in broker(docs)["env"] if e["name"] == "KVBROKER_BROKER_ID"]
    assert broker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Peers are dialed by pod IP, which the driver cannot put in a SAN: every broker verifies one shared name.
    assert settings(docs)["KVBROKER_PEER_TLS_SERVER_NAME"] in names
    assert {"server auth", "client auth"} <= set(listed(attrs["key-usages"]))  # mutual TLS
    assert attrs["fs-group"] == str(pod_spec(docs)["securityContext"]["runAsGroup"])  # the key is readable by us


def test_every_broker_trusts_and_is_signed_by_the_namespaces_ca_issuer(rendered, cert_manager):
    (issuer,) = [d for d in cert_manager if d["kind"] == "Issuer" and "ca" in d["spec"]]
    for role in rendered:
        attrs = attributes(rendered[role])
        assert (attrs["issuer-name"], attrs.get("issuer-kind", "Issuer")) == (issuer["metadata"]["name"], "Issuer")
        assert attrs.get("issuer-group", "cert-manager.io") == "cert-manager.io"


def test_peer_ca_objects_use_only_known_cert_manager_fields(cert_manager):
    assert {d["kind"] for d in cert_manager} == {"Issuer", "Certificate"}
    for doc in cert_manager:
        assert doc["apiVersion"] == "cert-manager.io/v1"
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(doc["spec"]) <= CERT_MANAGER_SPEC[doc["kind"]], doc["metadata"]["name"]
        assert "namespace" not in doc["metadata"], "it goes to the namespace of `kubectl apply -n`"


def test_ca_issuer_signs_with_a_ca_certificate_from_a_self_signed_issuer(cert_manager):
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in cert_manager}
    (ca_issuer,) = [d for d in cert_manager if d["kind"] == "Issuer" and "ca" in d["spec"]]
    (certificate,) = [d for d in cert_manager if d["kind"] == "Certificate"]
    assert certificate["spec"]["isCA"] is True
    assert certificate["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"]
    ref = certificate["spec"]["issuerRef"]
    assert ref.get("group", "cert-manager.io") == "cert-manager.io"
    assert by_name[(ref.get("kind", "Issuer"), ref["name"])]["spec"] == {"selfSigned": {}}


def test_peer_allow_placeholder_names_the_other_roles_pods(rendered):
    for role, docs in rendered.items():
        pattern = settings(docs)["KVBROKER_PEER_ALLOW"]
        other = one(rendered[OTHER_ROLE[role]], "Deployment")["metadata"]["name"]
        own = one(docs, "Deployment")["metadata"]["name"]
        assert fnmatchcase(f"{other}-6d4f9c7b8-x2k9q", pattern)  # a pod name of the Deployment
        assert not fnmatchcase(f"{own}-6d4f9c7b8-x2k9q", pattern)


def driver_like_identity(docs: list[dict], ca: trustme.CA, folder: Path, pod_name: str) -> None:
    """What csi-driver writes for a pod of `docs` named `pod_name`, signed by `ca`: the volume's files,
    with the SANs of its dns-names as the driver expands them."""
    attrs = attributes(docs)
    folder.mkdir(parents=True)
    cert = ca.issue_cert(*(name.replace("${POD_NAME}", pod_name) for name in listed(attrs["dns-names"])))
    cert.cert_chain_pems[0].write_to_path(str(folder / attrs.get("certificate-file", DRIVER_FILES["certificate-file"])))
    cert.private_key_pem.write_to_path(str(folder / attrs.get("privatekey-file", DRIVER_FILES["privatekey-file"])))
    ca.cert_pem.write_to_path(str(folder / attrs.get("ca-file", DRIVER_FILES["ca-file"])))


def pod_env(docs: list[dict], folder: Path, socket: str) -> dict[str, str]:
    """The broker container's environment, with the TLS volume at `folder` and the socket at `socket`."""
    mount = str(PurePosixPath(settings(docs)["KVBROKER_PEER_TLS_CERT"]).parent)
    env = {key: value.replace(mount, str(folder)) if key in TLS_FILES else value
           for key, value in settings(docs).items()}
    env.update(literal_env(broker(docs)), KVBROKER_LISTEN=socket, KVBROKER_METRICS_LISTEN="127.0.0.1:0",
               KVBROKER_HEALTH_LISTEN=socket.replace(".sock", "-health.sock"))
    return without_rdma(env)


@pytest.mark.integration
async def test_brokers_with_these_settings_transfer_over_mutual_tls_dialed_by_ip(rendered, backend, engines,
                                                                                   request_id, tmp_path):
    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
    from kvbroker_tools.launch import start_broker
    from tests.support.brokers import ALL, Broker, assert_bytes, expected_after

    ca, started = trustme.CA(), {}
    try:
        for role in ("decode", "prefill"):
            docs = rendered[role]
            folder, pod = tmp_path / role, f"{one(docs, 'Deployment')['metadata']['name']}-6d4f9c7b8-x2k9q"
            driver_like_identity(docs, ca, folder, pod)
            env = {**pod_env(docs, folder, f"unix:{tmp_path}/{role}.sock"), "KVBROKER_BACKEND": backend}
            process = await start_broker(pod, "--listen", env["KVBROKER_LISTEN"], env=env)
            channel = grpc.aio.insecure_channel(process.listen)
            started[role] = Broker(process, channel, bpb_grpc.BrokerServiceStub(channel))
        decode, prefill = started["decode"], started["prefill"]
        src = await engines.make(prefill, "prefill")
        dst = await engines.make(decode, "decode", fill="canary")
        before = dst.segment.array.copy()
        await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=request_id, engine_id=dst.engine_id, components=ALL, dst_page_ids=[5, 6, 1]), timeout=10)
        reply = await src.stub.Transfer(bpb.TransferRequest(
            request_id=request_id, engine_id=src.engine_id, peer_address=decode.peer_address,  # 127.0.0.1:port
            remote_engine_id=dst.engine_id, components=ALL, src_page_ids=[0, 1, 2]), timeout=30)
        assert reply.status.pages == 3
        assert_bytes(dst, expected_after(src, dst, before, ALL, [0, 1, 2], [5, 6, 1]))
        with pytest.raises(grpc.RpcError):  # what kubelet's gRPC probe would see: the port wants TLS
            check(decode.peer_address, timeout_s=2)
    finally:
        for one_broker in started.values():
            await one_broker.channel.close()
            await one_broker.process.stop()


@pytest.mark.integration
async def test_exec_probes_pass_as_kubelet_runs_them_and_fail_once_the_broker_stops(docs, tmp_path):
    from kvbroker_tools.launch import start_broker

    folder = tmp_path / "tls"
    driver_like_identity(docs, trustme.CA(), folder, "probe-pod")
    env = pod_env(docs, folder, f"unix:{tmp_path}/kvbroker.sock")
    process = await start_broker("probes", "--listen", env["KVBROKER_LISTEN"], env=env)
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")

    def run_probes() -> dict[str, int]:
        codes = {}
        for kind in kinds:
            command = [sys.executable, *broker(docs)[kind]["exec"]["command"][1:]]
            # kubelet runs an exec probe in the container, with the container's environment; the
            # timeout has slack over timeoutSeconds for a loaded test machine.
            done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=broker(docs)[kind]["timeoutSeconds"] * 4)
            codes[kind] = done.returncode
        return codes

    try:
        serving = run_probes()
    finally:
        await process.stop()
    assert serving == dict.fromkeys(kinds, 0)
    assert run_probes() == dict.fromkeys(kinds, 1)
