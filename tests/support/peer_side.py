"""What the integration tests share to stand on the peer plane beside real brokers: a PeerService of
the test's own that answers Handshake with what the test hands it (`Answers`, served by
tests/support/helpers.py's `peer_service`), a real broker's own Handshake answer (`real_handshake`, to lie
with), and a certificate of a test CA as a broker's files and a raw client's credentials (`Identity`).
Not a test module: test modules import from here, never from each other."""

from __future__ import annotations

import grpc
import trustme

from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc


class Identity:
    """A certificate of the CA for `name`, as files for a broker and as credentials for a raw client."""

    def __init__(self, ca: trustme.CA, directory, name: str) -> None:
        cert = ca.issue_cert(name, "127.0.0.1", "localhost")
        self.name = name
        self.paths = {kind: directory / f"{name}-{kind}.pem" for kind in ("cert", "key", "ca")}
        cert.private_key_pem.write_to_path(str(self.paths["key"]))
        cert.cert_chain_pems[0].write_to_path(str(self.paths["cert"]))
        ca.cert_pem.write_to_path(str(self.paths["ca"]))
        self.credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(), private_key=cert.private_key_pem.bytes(),
            certificate_chain=cert.cert_chain_pems[0].bytes())

    @property
    def flags(self) -> list[str]:
        return ["--peer-tls-cert", str(self.paths["cert"]), "--peer-tls-key", str(self.paths["key"]),
                "--peer-tls-ca", str(self.paths["ca"])]


class Answers(ppb_grpc.PeerServiceServicer):
    """A PeerService that answers Handshake with what the test hands it."""

    def __init__(self, handshake: ppb.HandshakeResponse) -> None:
        self.handshake = handshake
        self.handshakes = 0

    async def Handshake(self, request, context):
        self.handshakes += 1
        return self.handshake


async def real_handshake(broker, engine_id: str, backend: str, broker_id: str = "test") -> ppb.HandshakeResponse:
    async with grpc.aio.insecure_channel(broker.peer_address) as channel:
        return await ppb_grpc.PeerServiceStub(channel).Handshake(ppb.HandshakeRequest(
            broker_id=broker_id, engine_id=engine_id, backend=backend), timeout=10)
