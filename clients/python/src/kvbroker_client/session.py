"""The session that holds a client's engines (OpenSession), and the deadlines of its calls.

`Session.open` returns the id of an open session, opening one if none is; a task reads the
session's stream to learn when it ends, and then tells `on_lost` (BrokerClient registers its
engines again). `end` closes it: the broker then unregisters the engines it held.
`deadline` and `remaining` turn a call's timeout into a loop-time deadline and back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kvbroker_client.errors import DeadlineExceeded, Unavailable, from_rpc_error
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

log = logging.getLogger("kvbroker_client.client")


def deadline(timeout: float | None, default: float) -> float:
    return asyncio.get_running_loop().time() + (default if timeout is None else timeout)


def remaining(at: float) -> float:
    return max(0.0, at - asyncio.get_running_loop().time())


class Session:
    """One client's session on its broker; `enabled=False`: engines are registered without one."""

    def __init__(self, stub: bpb_grpc.BrokerServiceStub, target: str, holder: str, *, enabled: bool,
                 on_lost: Callable[[], None]) -> None:
        self._stub = stub
        self._target = target
        self._holder = holder
        self.enabled = enabled
        self._on_lost = on_lost  # the session ended while the client still had it open
        self.id = ""  # empty: no session open (none yet, or it ended)
        self.call: grpc.aio.UnaryStreamCall | None = None
        self._task: asyncio.Task | None = None  # reads the stream, to learn when it ends
        self._lock = asyncio.Lock()

    async def open(self, at: float) -> str:
        """The id of an open session, opened now if none is (by the deadline `at`); empty when disabled."""
        if not self.enabled:
            return ""
        async with self._lock:
            if self.id:
                return self.id
            call = self._stub.OpenSession(bpb.OpenSessionRequest(holder=self._holder))
            try:
                first = await asyncio.wait_for(call.read(), remaining(at))
            except TimeoutError:
                call.cancel()
                raise DeadlineExceeded(f"no session opened on {self._target} before the deadline") from None
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise Unavailable(f"the broker at {self._target} ended the session as it opened it (shutting down)")
            self.call, self.id = call, first.session_id
            self._task = asyncio.create_task(self._hold(call, first.session_id),
                                             name=f"kvbroker session {first.session_id}")
            return self.id

    async def _hold(self, call: grpc.aio.UnaryStreamCall, session_id: str) -> None:
        """Read the session's stream until it ends; then the session is gone, and so are its engines."""
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            reason = "the broker ended it"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        if self.id == session_id:
            self.id, self.call = "", None
            log.warning("session %s with %s ended (%s); the broker released its engines", session_id,
                        self._target, reason)
            self._on_lost()

    async def end(self) -> None:
        call, task = self.call, self._task
        self.id, self.call, self._task = "", None, None
        if call is not None:
            call.cancel()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
