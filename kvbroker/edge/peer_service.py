"""The PeerService servicer: the receiving side of broker to broker. Proto in, Broker call, proto
out; domain errors become status codes (edge/codes.py). The sending side is peers/clients.py.

Every call first establishes who the caller is (trust.PeerGate: under mutual TLS its broker_id
must be a name of its certificate) and whether `peer_allow` admits it; the calls that wait
(Handshake, RevokeOffer) count against the caller's share of the calls served at once
(trust.PeerCalls), and an offer against its quotas before its page lists are converted. A caller that is not
admitted gets, from Handshake, the very answer an unknown engine gets, so that engine ids cannot
be enumerated; from the other calls, PERMISSION_DENIED before any lookup.

- Handshake: an engine's layout and the transfer engine's metadata;
- ClaimGrant, CompleteTransfer: the claimed flow;
- OfferGrant, RevokeOffer: a receiver offers a grant to this broker, or revokes it;
- NotifyParts: a sender reports parts of grants this broker offered; NotifyStream, the same (and
  OfferGrant) as messages on one long-lived stream, each answered in order with its seq, a refused
  one with its code in its answer while the stream goes on (admission.py bounds the streams and
  their messages; the answers go through an Outbox, outbox.py, which bounds what they hold).
"""

from __future__ import annotations

import grpc

from kvbroker.core.errors import BrokerError, Code, invalid
from kvbroker.edge import convert
from kvbroker.edge.codes import failure, translate_errors
from kvbroker.edge.outbox import Outbox, StreamBounds, StreamObserver, serve
from kvbroker.edge.peer_quotas import peer_host
from kvbroker.edge.trust import PeerCalls, PeerGate, PeerIdentity
from kvbroker.flows.broker import Broker
from kvbroker.flows.registry import unknown_engine
from kvbroker.peers.notifier import MAX_BATCH
from kvbroker_client.codes import code_number
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc


class PeerServicer(ppb_grpc.PeerServiceServicer):
    def __init__(self, broker: Broker, gate: PeerGate, calls: PeerCalls | None = None, *,
                 streams: StreamBounds | None = None, observer: StreamObserver | None = None) -> None:
        self._broker = broker
        self._gate = gate
        self._calls = calls if calls is not None else PeerCalls(1 << 30, 1 << 30)
        self._streams = streams or StreamBounds()  # what a NotifyStream holds for a caller that does not read
        self._observer = observer

    def _caller(self, request, context, *, hide_as_engine: str | None = None, held: bool = False) -> PeerIdentity:
        """Who calls, admitted (else PERMISSION_DENIED, or with `hide_as_engine` the answer an unknown
        engine gets). A `held` call, one that waits (on the transfer engine, on writes) and so can be
        made to hold the broker, counts against the calls served at once until it ends
        (RESOURCE_EXHAUSTED); the others run to their answer without waiting."""
        try:
            identity = self._gate.identify(request.broker_id, context.auth_context(), peer_host(context.peer()))
            if not self._gate.admits(identity):
                raise BrokerError(Code.PERMISSION_DENIED, f"broker_id: peer {identity.name[:128]!r} is not admitted "
                                                          "by this broker's peer_allow")
        except BrokerError:
            if hide_as_engine is not None:
                raise unknown_engine(hide_as_engine) from None
            raise
        if held:
            self._calls.enter(identity.quota_key)
            context.add_done_callback(lambda _: self._calls.leave(identity.quota_key))
        return identity

    @translate_errors
    async def Handshake(self, request: ppb.HandshakeRequest, context) -> ppb.HandshakeResponse:
        self._caller(request, context, hide_as_engine=request.engine_id, held=True)
        view = await self._broker.handshake(request.backend, request.engine_id)
        return ppb.HandshakeResponse(
            broker_id=view.broker_id, epoch=view.epoch, generation=view.generation, backend=view.backend,
            backend_metadata=view.metadata, engine=convert.engine_layout_out(view.layout),
        )

    @translate_errors
    async def ClaimGrant(self, request: ppb.ClaimGrantRequest, context) -> ppb.ClaimGrantResponse:
        identity = self._caller(request, context)
        grant, generation = self._broker.claim(
            identity, request.engine_id, request.request_id,
            lambda: (convert.components_in(request.components), convert.page_ids_in(request.dst_page_ids)),
        )
        return ppb.ClaimGrantResponse(
            dst_page_ids=grant.dst_page_ids.tolist(), epoch=self._broker.epoch, generation=generation,
            claim_token=grant.claim_token, remaining_ms=int(grant.remaining_s * 1000),
        )

    @translate_errors
    async def CompleteTransfer(self, request: ppb.CompleteTransferRequest, context) -> ppb.CompleteTransferResponse:
        identity = self._caller(request, context)
        state = self._broker.complete(
            identity, request.engine_id, request.request_id, request.claim_token, succeeded=request.succeeded,
            code=request.code, reason=request.reason, pages=request.pages, runs=request.runs,
        )  # its bytes and truncated_pages are not read: the receiver counts its own (Receiver.complete)
        return ppb.CompleteTransferResponse(state=convert.enum_out(state, pb.TransferState))

    @translate_errors
    async def OfferGrant(self, request: ppb.OfferGrantRequest, context) -> ppb.OfferGrantResponse:
        return self._take_offer(request, context)

    def _take_offer(self, request: ppb.OfferGrantRequest, context) -> ppb.OfferGrantResponse:
        identity = self._caller(request, context)
        self._broker.receive_offer(identity, request.sender_engine_id, sum(len(p.page_ids) for p in request.pages),
                                   lambda max_pages: convert.grant_offer_in(request, max_pages), request.epoch)
        return ppb.OfferGrantResponse(broker_id=self._broker.broker_id, epoch=self._broker.epoch)

    @translate_errors
    async def RevokeOffer(self, request: ppb.RevokeOfferRequest, context) -> ppb.RevokeOfferResponse:
        identity = self._caller(request, context, held=True)
        quiesced = await self._broker.revoke_offer(identity, request.engine_id, request.request_id,
                                                   request.offer_token, request.code, request.reason,
                                                   context.time_remaining())
        return ppb.RevokeOfferResponse(quiesced=quiesced)

    @translate_errors
    async def NotifyParts(self, request: ppb.NotifyPartsRequest, context) -> ppb.NotifyPartsResponse:
        return ppb.NotifyPartsResponse(acks=self._take_notices(request, context))

    async def NotifyStream(self, requests, context):
        """Each request answered in turn through an Outbox: while the caller leaves its answers unread,
        up to the stream's bound, no more of its requests are read (outbox.py). A certificate that names
        no admitted peer is refused as the stream opens, so that it holds no stream slot."""
        if not self._gate.may_call(context.auth_context()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "NotifyStream: no name of the peer's certificate is admitted by this broker's "
                                "peer_allow")

        async def answer_each(outbox: Outbox) -> None:
            iterator = aiter(requests)
            while True:
                await outbox.room()
                try:
                    request = await anext(iterator)
                except StopAsyncIteration:
                    return
                await outbox.put(self._answer(request, context))

        await serve(context, self._streams, "NotifyStream", answer_each, self._observer)

    def _answer(self, request: ppb.NotifyStreamRequest, context) -> ppb.NotifyStreamResponse:
        try:
            if request.HasField("offer"):
                return ppb.NotifyStreamResponse(seq=request.seq, offer=self._take_offer(request.offer, context))
            acks = self._take_notices(request.notices, context)
        except Exception as exc:  # the status a NotifyParts (OfferGrant) call would have ended with
            code, reason = failure(exc, "NotifyStream")
            return ppb.NotifyStreamResponse(seq=request.seq, code=code_number(code), reason=reason)
        return ppb.NotifyStreamResponse(seq=request.seq, acks=ppb.NotifyPartsResponse(acks=acks))

    def _take_notices(self, request: ppb.NotifyPartsRequest, context) -> list[ppb.PartAck]:
        identity = self._caller(request, context)
        if len(request.notices) > MAX_BATCH:
            raise BrokerError(Code.RESOURCE_EXHAUSTED,
                              f"notices: {len(request.notices)} exceed the limit of {MAX_BATCH} per call")
        notices = []
        for i, notice in enumerate(request.notices):
            if len(notice.landed) > 16:
                raise invalid(f"notices[{i}].landed: {len(notice.landed)} entries; a part writes each component once")
            notices.append(convert.part_notice_in(notice, f"notices[{i}]"))
        return [convert.part_ack_out(a) for a in self._broker.take_notices(identity, notices)]
