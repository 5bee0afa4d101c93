"""What a client registered, and bringing it back after its broker restarted (BrokerClient's map
says when): `Registrations` remembers each engine's registration and the broker's epoch; `recover`
tells a new broker process (a new epoch) or a lost session from a failure, and registers the
engines again; `session_lost` does that at once when the session breaks (`rejoin`), so that a
peer's offer does not find the engine missing; `explain_lost` names an engine whose broker-owned
memory went with the old process.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvbroker_client.errors import BrokerError, NotFound, from_rpc_error
from kvbroker_client.session import Session, remaining
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

log = logging.getLogger("kvbroker_client.client")

# How long the client waits for its broker to come back after the session broke, to register its
# engines again at once (a peer's offer may arrive before this process calls again).
REJOIN_WINDOW_S = 60.0


class Registrations:
    def __init__(self, stub: bpb_grpc.BrokerServiceStub, target: str, session: Session) -> None:
        self._stub = stub
        self._target = target
        self._session = session
        self.engines: dict[str, bpb.RegisterEngineRequest] = {}  # what to register again after a restart
        self.lost: set[str] = set()  # broker-owned engines a restart took with it
        self.epoch: int | None = None
        self.broker_id = ""  # the broker's id and peer address as last seen: a restart may change them
        self.peer_address = ""
        self.restarts_seen = 0
        self._lock = asyncio.Lock()
        self._rejoin: asyncio.Task | None = None  # registers the engines again once a broken session's broker answers

    def explain_lost(self, error: BrokerError, request: object) -> BrokerError:
        engine_id = getattr(request, "engine_id", "")
        if isinstance(error, NotFound) and engine_id in self.lost:
            return NotFound(f"{error.reason}; engine {engine_id!r} had broker-owned memory, which went with the "
                            "broker's restart: register it again and use the new pool")
        return error

    async def recover(self, at: float, *, since: int | None = None,
                      seen: bpb.GetBrokerInfoResponse | None = None) -> bool:
        """True when the broker lost our engines (a new epoch: a new process; or our session ended)
        and they are registered again (by the deadline `at`)."""
        if self.epoch is None:
            return False
        session_before = self._session.id
        async with self._lock:
            if since is not None and self.epoch != since:
                return True  # another call recovered while this one waited for the lock
            if self._session.id and self._session.id != session_before:
                return True  # another recovery opened a new session meanwhile: `seen` predates it
            if seen is None:
                try:
                    seen = await self._stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=remaining(at),
                                                          wait_for_ready=True)
                except grpc.aio.AioRpcError:
                    return False  # still gone within the deadline: the caller sees the original error
            if seen.epoch == self.epoch:
                open_sessions = {s.session_id for s in seen.sessions}
                if not (self._session.enabled and self.engines and self._session.id not in open_sessions):
                    return False
                log.warning("broker %s ended this client's session; registering %d engine(s) again",
                            self._target, len(self.engines))
            else:
                log.warning("broker %s restarted (epoch %d -> %d); registering %d engine(s) again",
                            self._target, self.epoch, seen.epoch, len(self.engines))
            await self._session.end()  # whatever the client still holds of the old session
            await self._register_again(at, {e.engine_id for e in seen.engines})
            if seen.epoch != self.epoch:
                self.restarts_seen += 1  # counted once: a failed registration is retried under the same epoch
            self.epoch = seen.epoch  # only now: a call that sees the new epoch first waits for the lock
            self.saw(seen)
            return True

    def saw(self, info: bpb.GetBrokerInfoResponse) -> None:
        """The broker's identity from one of its answers: a broker restarted under another id or on
        another peer address is what the other side's broker must be told from now on."""
        self.broker_id, self.peer_address = info.broker_id, info.peer_address

    async def _register_again(self, at: float, present: set[str]) -> None:
        failures: list[BrokerError] = []
        for engine_id, request in list(self.engines.items()):
            if engine_id in present:
                continue
            if request.memory_ownership == bpb.MEMORY_OWNERSHIP_BROKER:
                del self.engines[engine_id]
                self.lost.add(engine_id)
                log.error("engine %s had broker-owned memory, which went with the broker's restart; the server "
                          "must register it again and use the new pool", engine_id)
                continue
            try:
                request.session_id = await self._session.open(at)
                await self._stub.RegisterEngine(request, timeout=remaining(at))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.ALREADY_EXISTS:
                    failures.append(from_rpc_error(exc))
                    log.error("could not register engine %s again: %s", engine_id, failures[-1])
            except BrokerError as exc:
                failures.append(exc)
                log.error("could not register engine %s again: %s", engine_id, exc)
        if failures:
            raise failures[0]

    def session_lost(self) -> None:
        """The session broke under us: rejoin, if there is anything to register again."""
        if self.engines and (self._rejoin is None or self._rejoin.done()):
            self._rejoin = asyncio.get_running_loop().create_task(self._rejoin_now(),
                                                                  name=f"kvbroker rejoin {self._target}")

    async def _rejoin_now(self) -> None:
        """The session broke under us (the broker restarted, or the stream dropped): register the engines
        again as soon as the broker answers, within REJOIN_WINDOW_S, rather than at this process's next
        call: a peer broker's offer for one of them may come first, and would find no engine. Calls
        that miss an engine still recover them themselves (`recover`); the lock makes it happen once."""
        loop = asyncio.get_running_loop()
        at, delay = loop.time() + REJOIN_WINDOW_S, 0.05
        while loop.time() < at:
            try:
                if await self.recover(at) or self._session.id:
                    return  # registered again, by us or by a call
            except BrokerError as exc:  # e.g. the old broker, still draining, refused the session
                log.info("registering engines again on %s: %s; retrying", self._target, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        log.warning("broker %s did not take this client's engines back within %.0fs; the next call will",
                    self._target, REJOIN_WINDOW_S)

    async def close(self) -> None:
        rejoin, self._rejoin = self._rejoin, None
        if rejoin is not None:
            rejoin.cancel()
            await asyncio.gather(rejoin, return_exceptions=True)
