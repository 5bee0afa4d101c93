"""BrokerService servicer: proto in, domain call, proto out; domain errors become status codes."""

from __future__ import annotations

import contextlib

from kvbroker import __version__
from kvbroker.core.errors import BrokerError, invalid
from kvbroker.edge import convert
from kvbroker.edge.codes import details, status_code, translate_errors
from kvbroker.edge.trust import PeerGate
from kvbroker.flows.broker import Broker
from kvbroker.flows.part_sender import PartCommand
from kvbroker.flows.receiver import GrantCommand
from kvbroker.flows.sender import TransferCommand
from kvbroker.peers.clients import PeerClients
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc


class BrokerServicer(bpb_grpc.BrokerServiceServicer):
    def __init__(self, broker: Broker, peers: PeerClients, peer_address: str, unregister_wait_s: float,
                 gate: PeerGate | None = None, data_plane=None) -> None:
        self._broker = broker
        self._data_plane = data_plane  # server.DataPlane: the data port's fence, for GetBrokerInfo
        self._peers = peers
        self._peer_address = peer_address
        self._unregister_wait_s = unregister_wait_s
        self._gate = gate or PeerGate(["*"], authenticated=False)

    def _engine_info(self, engine) -> bpb.EngineInfo:
        return bpb.EngineInfo(
            engine_id=engine.engine_id, topology=convert.topology_out(engine.spec.topology),
            components=[convert.component_spec_out(c) for c in engine.spec.components],
            registered_bytes=engine.registered_bytes, memory_ownership=convert.memory_ownership_out(engine.spec),
            session_id=engine.session_id,
        )

    async def OpenSession(self, request, context):
        try:
            session = self._broker.open_session(request.holder)
        except BrokerError as exc:
            await context.abort(status_code(exc.code), details(exc.message))
        try:
            yield bpb.OpenSessionResponse(session_id=session.session_id)
            await self._broker.stopping.wait()  # or the caller goes: the handler is cancelled
        finally:
            self._broker.end_session(session.session_id, self._unregister_wait_s)

    @translate_errors
    async def RegisterEngine(self, request, context):
        engine = await self._broker.register_engine(convert.engine_spec_in(request), request.session_id)
        return bpb.RegisterEngineResponse(engine=self._engine_info(engine))

    @translate_errors
    async def UnregisterEngine(self, request, context):
        failed = await self._broker.unregister_engine(request.engine_id, self._unregister_wait_s)
        return bpb.UnregisterEngineResponse(failed_requests=failed)

    @translate_errors
    async def ExpectTransfer(self, request, context):
        self._broker.registry.get(request.engine_id)  # NOT_FOUND before any page array is built
        if request.pages and (request.components or request.dst_page_ids):
            raise invalid("pages: give either pages, or components with dst_page_ids, not both")
        if request.pages:
            pages, shared = convert.grant_pages_in(request.pages), False
        else:
            ids = convert.page_ids_in(request.dst_page_ids)
            pages, shared = [(kind, ids) for kind in convert.components_in(request.components)], True
        command = GrantCommand(request.request_id, request.engine_id, tuple(pages), request.expiry_ms,
                               request.sender_address, request.sender_engine_id, shared)
        status = await self._broker.expect_transfer(command)
        return bpb.ExpectTransferResponse(status=convert.status_out(status))

    @translate_errors
    async def Transfer(self, request, context):
        self._broker.registry.get(request.engine_id)  # NOT_FOUND before any page array is built
        """The claimed flow when the request names the receiver (peer_address), else the offered flow."""
        if request.peer_address or request.remote_engine_id:
            if request.pages or request.more_parts or request.aux:
                raise invalid("pages: the claimed flow (peer_address set) takes components and src_page_ids; "
                              "pages, more_parts and aux belong to the offered flow (peer_address empty)")
            command = TransferCommand(
                request.request_id, request.engine_id, request.peer_address, request.remote_engine_id,
                convert.components_in(request.components), convert.page_ids_in(request.src_page_ids),
                convert.page_ids_in(request.dst_page_ids),
            )
            status = await self._broker.transfer(command, context.time_remaining())
        else:
            if request.dst_page_ids:
                raise invalid("dst_page_ids: the offered flow places pages by PartPages.dst_offset")
            if request.pages and (request.components or request.src_page_ids):
                raise invalid("pages: give either pages, or components with src_page_ids, not both")
            if request.pages:
                pages = convert.part_pages_in(request.pages)
            else:
                ids = convert.page_ids_in(request.src_page_ids)
                pages = [(kind, ids, 0) for kind in convert.components_in(request.components)]
            command = PartCommand(request.request_id, request.engine_id, tuple(pages), not request.more_parts,
                                  request.aux)
            status = await self._broker.send_part(command, context.time_remaining())
        return bpb.TransferResponse(status=convert.status_out(status))

    async def WatchTransfer(self, request, context):
        try:
            updates = self._broker.watch(request.engine_id, request.request_id)
        except BrokerError as exc:
            await context.abort(status_code(exc.code), details(exc.message))
        async with contextlib.aclosing(updates):
            async for status in updates:
                yield bpb.WatchTransferResponse(status=convert.status_out(status))

    @translate_errors
    async def CancelTransfer(self, request, context):
        status = await self._broker.cancel(request.engine_id, request.request_id, request.reason)
        return bpb.CancelTransferResponse(status=convert.status_out(status))

    @translate_errors
    async def GetBrokerInfo(self, request, context):
        broker = self._broker
        return bpb.GetBrokerInfoResponse(
            broker_id=broker.broker_id, epoch=broker.epoch, version=__version__, backend=broker.backend.name,
            peer_address=self._peer_address,
            engines=[self._engine_info(e) for e in broker.registry],
            peers=[bpb.PeerInfo(address=p.address, broker_id=p.broker_id, epoch=p.epoch, handshakes=p.handshakes)
                   for p in self._peers.records.values()],
            request_counts=dict(broker.table.counts),
            sessions=[bpb.SessionInfo(session_id=x.session_id, holder=x.holder, engine_ids=sorted(x.engine_ids),
                                      opened_unix_ms=int(x.opened_at * 1000))
                      for x in broker.sessions()],
            peers_authenticated=self._gate.authenticated, peer_allow=list(self._gate.allow),
            data_port_range=getattr(self._data_plane, "data_port_range", ""),
            data_port_unprotected=getattr(self._data_plane, "unprotected", ""),
        )

