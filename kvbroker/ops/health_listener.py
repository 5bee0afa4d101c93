"""grpc.health.v1 on a listener of its own (the `health_listen` setting), answered from threads of its
own: what the probes ask (deploy/, the Dockerfile's HEALTHCHECK, kvbroker.ops.probe).

Why: the local API and the peer port share one process and one asyncio loop, and a busy peer flood
(big requests parsed in the loop, ~0.1 CPU-s per 9 MB) delays every callback behind it, the local
API's health too (benchmarks/health_flood.py, README "Health and probes"). This listener is grpc's
synchronous server: its completion queue is polled by grpc's own thread and Check runs in a small
pool, so an answer waits for the GIL (a parse holds it for one call at a time), not for the loop's
backlog. It serves Check only: Watch holds a pool thread for as long as it runs, so it is refused
(UNIMPLEMENTED, naming the local API, where Watch is served); nor does it serve reflection.

A thread answers even when the loop is wedged, which would blind the liveness probe: so the loop
beats (`beat`, every health_beat_s from server.py), and Check answers NOT_SERVING while the last beat
is older than `stall_s` (health_stall_s, 20 s by default: longer than any flood's delay measured,
3 s, shorter than the manifests' liveness window, 30 s), whatever the status set. Its threads and
the calls it holds at once are settings too (health_threads, health_max_calls: Check is a dict lookup
under a lock, so two threads answer a probe while the other is slow to send; calls past the bound are
refused RESOURCE_EXHAUSTED, not queued behind a flood of probes).

`HealthListener`: bind (host:port, port 0 resolved; a Unix socket is bound by server.bind_unix on
`.server`), start, serving / draining (thread-safe: grpc_health's synchronous HealthServicer takes
a lock), stop. The status follows the broker's lifecycle exactly as the aio health of the two API listeners.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvbroker.ops.thread_names import named_pool

OPTIONS: list[tuple[str, object]] = [("grpc.max_receive_message_length", 4096),  # a HealthCheckRequest is a name
                                     ("grpc.so_reuseport", 0)]


class CheckOnlyHealth(health.HealthServicer):
    """grpc_health's thread-safe servicer without Watch, whose stream would hold a pool thread, and
    NOT_SERVING while `stalled()`."""

    def __init__(self, stalled: Callable[[], bool]) -> None:
        super().__init__()
        self._stalled = stalled

    def Check(self, request, context):  # noqa: N802 (grpc's name)
        reply = super().Check(request, context)
        if self._stalled() and reply.status == health_pb2.HealthCheckResponse.SERVING:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return reply

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802 (grpc's name)
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "the health listener (health_listen) answers Check only; Watch is served on the local API "
                      "(listen)")


class HealthListener:
    def __init__(self, services: tuple[str, ...], *, stall_s: float, threads: int, max_calls: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._services = ("", *services)
        self._clock, self._stall_s = clock, stall_s
        self._beaten = clock()
        self._servicer = CheckOnlyHealth(lambda: self._clock() - self._beaten > self._stall_s)
        self._server = grpc.server(named_pool(threads, "kvbroker-health"),
                                   options=OPTIONS, maximum_concurrent_rpcs=max_calls)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        self.not_serving()  # bound and started before the broker is: NOT_SERVING until serving()

    @property
    def server(self) -> grpc.Server:
        """For server.bind_unix, which binds a Unix socket with its final mode."""
        return self._server

    def bind(self, address: str) -> str:
        """Bind host:port (port 0 picks one); returns the address as bound. OSError when it cannot."""
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind health_listen {address}")
        return f"{address.rpartition(':')[0]}:{port}"

    def start(self) -> None:
        self._server.start()

    def beat(self) -> None:
        """The loop is alive (a float store: atomic under the GIL)."""
        self._beaten = self._clock()

    def serving(self) -> None:
        for name in self._services:
            self._servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def not_serving(self) -> None:
        for name in self._services:
            self._servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def draining(self) -> None:
        """NOT_SERVING for good: later serving() calls change nothing (as the aio servicers' shutdown)."""
        self._servicer.enter_graceful_shutdown()

    def stop(self, grace_s: float) -> None:
        """Stop answering; blocks up to `grace_s` for the calls in flight (checks: microseconds)."""
        self._server.stop(grace_s).wait(grace_s + 1.0)
