"""BrokerService servicer: proto in, domain call, proto out; domain errors become status codes. The
streams it writes (OpenSession, WatchTransfer; Exchange in exchange.py) write through an Outbox
(outbox.py), bounded by the Exchanges' StreamBounds."""

from __future__ import annotations

import contextlib

from kvbroker import __version__
from kvbroker.core.errors import BrokerError
from kvbroker.edge import convert
from kvbroker.edge.codes import details, status_code, translate_errors
from kvbroker.edge.exchange import Exchanges
from kvbroker.edge.outbox import Outbox, serve
from kvbroker.edge.trust import PeerGate
from kvbroker.flows.broker import Broker
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

DEADLINE_MARGIN_S = 0.05  # an offer wait ends this long before the caller's deadline, for the answer to reach it


class BrokerServicer(bpb_grpc.BrokerServiceServicer):
    def __init__(self, broker: Broker, unregister_wait_s: float, gate: PeerGate | None = None,
                 data_plane=None, exchanges: Exchanges | None = None) -> None:
        self._broker = broker
        self.exchanges = exchanges or Exchanges(broker, max_commands=1024, settle_s=broker.limits.peer_settle_s)
        self._data_plane = data_plane  # server.DataPlane: the data port's fence, for GetBrokerInfo
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
            await context.abort(status_code(exc.code), details(exc.reason))

        async def hold(outbox: Outbox) -> None:
            await outbox.put(bpb.OpenSessionResponse(session_id=session.session_id))
            await self._broker.stopping.wait()  # or the caller goes: the handler is cancelled

        try:
            await serve(context, self.exchanges.bounds, "OpenSession", hold, self.exchanges.observer)
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
        status = await self._broker.expect_transfer(request.engine_id, lambda: convert.grant_command_in(request))
        return bpb.ExpectTransferResponse(status=convert.status_out(status))

    @translate_errors
    async def Transfer(self, request, context):
        """The claimed flow when the request names the receiver (peer_address), else the offered
        flow: convert picks the command, the Broker its sender."""
        status = await self._broker.transfer(request.engine_id, lambda: convert.transfer_command_in(request),
                                             context.time_remaining())
        return bpb.TransferResponse(status=convert.status_out(status))

    async def WatchTransfer(self, request, context):
        try:
            updates = await self._broker.watch(request.engine_id, request.request_id, states_only=request.states_only,
                                               terminal_only=request.terminal_only,
                                               offer_wait_s=_offer_wait_s(request.offer_wait_ms, context))
        except BrokerError as exc:
            await context.abort(status_code(exc.code), details(exc.reason))

        async def follow(outbox: Outbox) -> None:
            async with contextlib.aclosing(updates):
                async for status in updates:
                    await outbox.put(bpb.WatchTransferResponse(status=convert.status_out(status)))

        await serve(context, self.exchanges.bounds, "WatchTransfer", follow, self.exchanges.observer)

    async def Exchange(self, request_iterator, context):
        """The command stream: each command the Broker call of its unary RPC (edge/exchange.py)."""
        await self.exchanges.serve(request_iterator, context)

    @translate_errors
    async def CancelTransfer(self, request, context):
        status = await self._broker.cancel(request.engine_id, request.request_id, request.reason,
                                           _offer_wait_s(request.offer_wait_ms, context))
        return bpb.CancelTransferResponse(status=convert.status_out(status))

    @translate_errors
    async def GetBrokerInfo(self, request, context):
        info = self._broker.info()
        return bpb.GetBrokerInfoResponse(
            broker_id=info.broker_id, epoch=info.epoch, version=__version__, backend=info.backend,
            peer_address=info.peer_address,
            engines=[self._engine_info(e) for e in info.engines],
            peers=[bpb.PeerInfo(address=p.address, broker_id=p.broker_id, epoch=p.epoch, handshakes=p.handshakes)
                   for p in info.peers],
            request_counts=info.request_counts,
            sessions=[bpb.SessionInfo(session_id=x.session_id, holder=x.holder, engine_ids=sorted(x.engine_ids),
                                      opened_unix_ms=int(x.opened_at * 1000))
                      for x in info.sessions],
            peers_authenticated=self._gate.authenticated, peer_allow=list(self._gate.allow),
            data_port_range=getattr(self._data_plane, "data_port_range", ""),
            data_port_unprotected=getattr(self._data_plane, "unprotected", ""),
        )


def _offer_wait_s(offer_wait_ms: int, context) -> float:
    """A request's offer_wait_ms in seconds, ending a little before the caller's deadline: a wait that
    finds no offer answers NOT_FOUND, not the caller's DEADLINE_EXCEEDED."""
    remaining = context.time_remaining()
    wait = offer_wait_ms / 1000
    return wait if remaining is None else max(0.0, min(wait, remaining - DEADLINE_MARGIN_S))
