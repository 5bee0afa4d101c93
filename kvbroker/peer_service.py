"""The PeerService servicer: the receiving side of broker to broker (Handshake, ClaimGrant,
CompleteTransfer). Proto in, Broker call, proto out; domain errors become status codes (edge.py).
The sending side is peer_clients.py."""

from __future__ import annotations

from kvbroker import convert
from kvbroker.backends.base import TransferFailed
from kvbroker.broker import Broker
from kvbroker.edge import translate_errors
from kvbroker.errors import BrokerError, Code
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc


class PeerServicer(ppb_grpc.PeerServiceServicer):
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @translate_errors
    async def Handshake(self, request: ppb.HandshakeRequest, context) -> ppb.HandshakeResponse:
        backend = self._broker.backend
        if request.backend != backend.name:
            raise BrokerError(Code.FAILED_PRECONDITION,
                              f"backend: caller uses {request.backend!r}, this broker uses {backend.name!r}")
        engine = self._broker.handshake_view(request.engine_id)
        try:
            metadata = await backend.metadata()
        except TransferFailed as exc:
            raise BrokerError(Code.ABORTED, f"transfer engine {backend.name}: {exc}") from exc
        return ppb.HandshakeResponse(
            broker_id=self._broker.broker_id, epoch=self._broker.epoch, generation=engine.generation,
            backend=backend.name, backend_metadata=metadata, engine=convert.engine_layout_out(engine.layout),
        )

    @translate_errors
    async def ClaimGrant(self, request: ppb.ClaimGrantRequest, context) -> ppb.ClaimGrantResponse:
        self._broker.check_claimable(request.engine_id, request.request_id)  # before any page array is built
        grant, generation = self._broker.claim(
            request.engine_id, request.request_id, convert.components_in(request.components),
            convert.page_ids_in(request.dst_page_ids), claimant=request.broker_id,
        )
        return ppb.ClaimGrantResponse(
            dst_page_ids=grant.dst_page_ids.tolist(), epoch=self._broker.epoch, generation=generation,
            claim_token=grant.claim_token, remaining_ms=int(grant.remaining_s * 1000),
        )

    @translate_errors
    async def CompleteTransfer(self, request: ppb.CompleteTransferRequest, context) -> ppb.CompleteTransferResponse:
        state = self._broker.complete(
            request.engine_id, request.request_id, request.claim_token, request.broker_id,
            succeeded=request.succeeded, code=request.code, reason=request.reason, pages=request.pages,
            runs=request.runs, nbytes=request.bytes, truncated=request.truncated_pages,
        )
        return ppb.CompleteTransferResponse(state=int(state))
