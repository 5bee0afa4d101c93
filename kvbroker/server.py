"""Assembles and runs one broker: `BrokerServer.serve()` is startup() → wait → shutdown(), built
from one Settings object, with the signals captured for as long as it runs.

startup: the open-file limit raised, backend, epoch, peer clients, Broker, both gRPC servers
(local API and peer API, each with health and reflection, each behind an Admission interceptor:
admission.py), listeners bound, the metrics endpoint if configured, health SERVING.
wait: until the first SIGTERM or SIGINT (`capture_signals`; a second one forces an exit).
shutdown: NOT_SERVING at once, drain in-flight transfers within the grace period, stop the
servers, release engines and the backend, stop the metrics endpoint. With `health_listen`, a third
listener answers grpc.health.v1 Check from threads of its own (ops/health_listener.py), so that a
busy peer flood in the loop does not delay the probes; its status follows the other two, and the
loop's heartbeat (a wedged loop is NOT_SERVING there too). Tests call startup and
shutdown directly; `kvbroker serve` (cli.py) calls serve. Its parts: `new_epoch`, `peer_credentials`
(TLS of the peer port), `peer_server_options` (the peer port's bounds in grpc core), `bind_unix`
(the local socket, created with its final mode), `raise_fd_limit`, `Endpoints` (the addresses as bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbroker.backends import create_backend, transports
from kvbroker.config import Settings
from kvbroker.edge.admission import Admission
from kvbroker.edge.exchange import Exchanges
from kvbroker.edge.outbox import StreamBounds
from kvbroker.edge.peer_quotas import PeerReads, StreamQuota
from kvbroker.edge.peer_service import PeerServicer
from kvbroker.edge.request_limits import NOTICE_STREAMS, RequestLimits
from kvbroker.edge.service import BrokerServicer
from kvbroker.edge.tls import PeerTls
from kvbroker.edge.trust import PeerCalls, PeerGate
from kvbroker.flows.broker import Broker
from kvbroker.flows.limits import Limits
from kvbroker.ops.health_listener import HealthListener
from kvbroker.ops.metrics import Metrics
from kvbroker.ops.trim import MemoryTrim
from kvbroker.peers.clients import PeerClients
from kvbroker_client.v1 import broker_service_pb2, broker_service_pb2_grpc, peer_service_pb2, peer_service_pb2_grpc

log = logging.getLogger(__name__)

BROKER_SERVICE = broker_service_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name
PEER_SERVICE = peer_service_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name


@dataclass(frozen=True)
class Endpoints:
    listen: str  # the local API as bound (port 0 resolved)
    peer_listen: str
    peer_address: str  # what peers are told to dial
    metrics_listen: str = ""  # the metrics endpoint as bound; empty when off
    health_listen: str = ""  # the health listener as bound; empty when off


def new_epoch() -> int:
    """This broker process's epoch: different on every start (the clock, mixed with the pid), not ordered."""
    return time.time_ns() ^ (os.getpid() << 20)


def peer_credentials(s: Settings) -> tuple[grpc.ServerCredentials | None, PeerTls | None]:
    """TLS for the peer port: served with our certificate; with a CA, peers must present one it signed.
    The files are re-read when they change (tls.py)."""
    if not s.peer_tls_cert:
        return None, None
    tls = PeerTls(s.peer_tls_cert, s.peer_tls_key, s.peer_tls_ca)
    return tls.server_credentials(), tls


SOCKET_MODE = 0o660  # the local API's Unix socket: the broker's user and group (the inference server)
SOCKET_DIR_MODE = 0o750  # a directory the broker creates for it


@dataclass(frozen=True)
class UnixSocket:
    path: Path
    inode: int  # of the socket bound: shutdown removes the path only while it is still this socket


def bind_unix(server: grpc.aio.Server | grpc.Server, path: Path) -> UnixSocket:
    """Bind `path` with its final mode from the first moment anyone can reach it: grpc binds in a
    private directory (0700) beside it, the socket gets SOCKET_MODE there and is renamed into place.
    A umask around the bind would do it too, but the umask is the process's, and other threads
    create files meanwhile. Directories missing on the way are created SOCKET_DIR_MODE."""
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=SOCKET_DIR_MODE)
            os.chmod(directory, SOCKET_DIR_MODE)  # whatever the umask took away, or left
    staging = Path(tempfile.mkdtemp(prefix=".kvb", dir=path.parent))
    try:
        bound = staging / "s"
        server.add_insecure_port(f"unix:{bound}")
        os.chmod(bound, SOCKET_MODE)
        os.replace(bound, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return UnixSocket(path, os.stat(path).st_ino)


def unix_path(address: str) -> Path:
    return Path(address.removeprefix("unix:").removeprefix("//"))


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit, so that a flood of peer
    connections (bounded by max_peer_connections) leaves fds for the local API, engines' segments and
    the transfer engine; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        with contextlib.suppress(OSError, ValueError):
            hard = int(Path("/proc/sys/fs/nr_open").read_text())
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


@dataclass(frozen=True)
class DataPlane:
    """How this broker's data port is fenced, for the start-up log and GetBrokerInfo."""

    data_port_range: str  # "" when unset: the engines listen on every interface, on any port
    unprotected: str  # why its transports may write outside registered memory; "" when they cannot


def check_data_plane(s: Settings, ucx_tls: str | None) -> DataPlane:
    """Refuse (ValueError) transports that let a forged remote region write outside registered memory,
    unless allow_unprotected_transports; warn when they are allowed and when the data port is open
    to all (data_port_range unset)."""
    why = transports.unprotected(s.backend, ucx_tls)
    if why and not s.allow_unprotected_transports:
        raise ValueError(f"backend {s.backend}: {why}. A peer that reaches the data port, or hands this broker a "
                         "handshake naming a region nobody registered, then writes and reads outside registered "
                         "memory (README.md, Security). Set UCX_TLS to RDMA or GPU IPC transports (e.g. "
                         "rc,cuda_ipc,cuda_copy), or allow_unprotected_transports=true "
                         "(KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS) with the data port fenced (data_port_range and "
                         "a NetworkPolicy)")
    if why:
        log.warning("data port unprotected (allow_unprotected_transports): %s; whoever reaches it, and an admitted "
                    "peer that lies in its handshake, can write and read any address of this process", why)
    if not s.data_port_range:
        log.warning("data_port_range is unset: the transfer engines listen on every interface, on ports no "
                    "NetworkPolicy can name, open to all who reach the pod; set data_port_range and fence it "
                    "(README.md, Security)")
    return DataPlane(s.data_port_range, why)


def peer_server_options(s: Settings) -> list[tuple[str, object]]:
    """The peer port's bounds in grpc core: message size (a larger one is refused unread, with grpc's
    own RESOURCE_EXHAUSTED "Received message larger than max (N vs. M)"), streams per connection,
    connections (more are closed as they are accepted), and how long a connection may sit in its
    TLS and HTTP/2 handshake or idle."""
    return [("grpc.max_receive_message_length", s.peer_message_bytes),
            ("grpc.max_send_message_length", s.peer_message_bytes),
            ("grpc.max_concurrent_streams", s.max_peer_streams),
            # With grpc's overload protection the limit holds before the peer has seen it: a burst of
            # calls on a new connection got REFUSED_STREAM (UNAVAILABLE), 3-23 of 300 with a limit of
            # 10, and 256 concurrent transfers failed so. Without it the limit holds once the peer
            # has acknowledged our settings, which it must within the handshake timeout.
            ("grpc.http.overload_protection", 0),
            ("grpc.http2.settings_timeout", int(s.peer_handshake_timeout_s * 1000)),
            ("grpc.max_allowed_incoming_connections", s.max_peer_connections),
            ("grpc.server_handshake_timeout_ms", int(s.peer_handshake_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", int(s.peer_connection_idle_s * 1000)),
            # Without BDP probing a stream's window stays at 64 KiB: a call waiting for a read slot
            # (admission.py) holds that much of its request, not megabytes (measured: 16 waiting
            # 20 MiB calls took 70 MB with it, nothing without).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.so_reuseport", 0)]


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> str:
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    host = address.rpartition(":")[0]
    return f"{host}:{port}"


FORCED_EXIT = 130  # the exit status when a second signal cuts the drain short


@contextlib.contextmanager
def capture_signals(stop: asyncio.Event, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
                    ) -> Iterator[None]:
    """While inside: the first of `signals` sets `stop` (drain, then exit), a second one exits the
    process at once with os._exit(FORCED_EXIT). The handlers found on entry are put back on exit."""
    loop = asyncio.get_running_loop()
    received = 0

    def on_signal(signum: int) -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.info("received %s: draining (send again to force)", signal.Signals(signum).name)
            stop.set()
        else:
            log.warning("received %s again: exiting now", signal.Signals(signum).name)
            os._exit(FORCED_EXIT)

    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            if handler is not None:  # None: not installed from Python, nothing to put back
                signal.signal(signum, handler)


class BrokerServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.broker: Broker | None = None
        self.endpoints: Endpoints | None = None
        self._servers: list[grpc.aio.Server] = []
        self._health: list[health.aio.HealthServicer] = []
        self._peers: PeerClients | None = None
        self._exchanges: Exchanges | None = None
        self._sockets: list[UnixSocket] = []
        self._health_listener: HealthListener | None = None
        self._beating: asyncio.Task[None] | None = None
        self._trim = MemoryTrim()
        self.metrics = Metrics()

    def _grpc_server(self, service_name: str, options: Sequence[tuple[str, object]], admission: Admission
                     ) -> grpc.aio.Server:
        server = grpc.aio.server(options=options, interceptors=[admission])
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        reflection.enable_server_reflection(
            [service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        self._servers.append(server)
        self._health.append(servicer)
        return server

    async def startup(self) -> Endpoints:
        s = self.settings
        data_plane = check_data_plane(s, os.environ.get("UCX_TLS"))
        backend = create_backend(s, f"{s.broker_id}-{os.getpid()}")
        limits = Limits.from_settings(s)
        epoch = new_epoch()
        server_credentials, tls = peer_credentials(s)
        log.info("open-file limit %d", raise_fd_limit())
        channel_options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", s.peer_message_bytes),  # a peer's answers too
            ("grpc.max_send_message_length", s.peer_message_bytes)]
        if s.peer_tls_server_name:
            channel_options.append(("grpc.ssl_target_name_override", s.peer_tls_server_name))
        peer_limits = RequestLimits(s.peer_message_bytes, "max_peer_message_bytes", s.max_pages_per_request,
                                    s.max_layer_buffers, s.notice_stream_bytes)
        peer_reads = PeerReads(s.max_peer_reads, s.max_reads_per_peer, s.peer_rpc_timeout_s)
        peer_admission = Admission(peer_limits, peer_reads, trim=self._trim, counted=self.metrics.refusal("peer"),
                                   messages=(self.metrics.messages, "peer"),
                                   streams=StreamQuota(s.max_peer_notice_streams, s.max_notice_streams_per_peer),
                                   unserved=frozenset() if s.peer_notice_stream else frozenset(NOTICE_STREAMS))
        peer_server = self._grpc_server(PEER_SERVICE, peer_server_options(s), peer_admission)
        peer_listen = _bind(peer_server, s.peer_listen, server_credentials)  # its port goes into our offers
        peer_address = f"{s.advertised_host}:{peer_listen.rpartition(':')[2]}"
        gate = PeerGate(s.peer_allow_patterns, authenticated=bool(s.peer_tls_ca))
        if not gate.authenticated:
            log.warning("peers are not authenticated: without mutual TLS (peer_tls_cert, peer_tls_key and "
                        "peer_tls_ca) a peer's broker_id is its own claim, and peer_allow can only trust it")
        peers = PeerClients(s.broker_id, epoch, backend, idle_s=s.peer_idle_s, rpc_timeout_s=s.peer_rpc_timeout_s,
                            channel_options=channel_options,
                            credentials=None if tls is None else tls.channel_credentials,
                            metrics=self.metrics, limits=peer_limits, notice_stream=s.peer_notice_stream)
        broker = Broker(s.broker_id, epoch, backend, limits, peers, metrics=self.metrics, peer_address=peer_address)
        await broker.start()
        self.broker, self._peers = broker, peers
        calls = PeerCalls(s.max_peer_calls, s.max_peer_calls_per_peer)
        streams = StreamBounds.from_settings(s)
        peer_service_pb2_grpc.add_PeerServiceServicer_to_server(
            PeerServicer(broker, gate, calls, streams=streams, observer=self.metrics), peer_server)
        if not s.peer_tls_ca and peer_listen.rpartition(":")[0] not in ("127.0.0.1", "[::1]", "localhost"):
            log.warning("the peer port %s accepts brokers it cannot authenticate; set peer_tls_cert, "
                        "peer_tls_key and peer_tls_ca for mutual TLS", peer_listen)

        local_options = [("grpc.max_receive_message_length", s.max_message_bytes),
                         ("grpc.max_send_message_length", s.max_message_bytes), ("grpc.so_reuseport", 0)]
        local_limits = RequestLimits(s.max_message_bytes, "max_message_bytes", s.max_pages_per_request,
                                     s.max_layer_buffers)
        local_admission = Admission(local_limits, trim=self._trim, counted=self.metrics.refusal("local"),
                                    messages=(self.metrics.messages, "local"))
        local_server = self._grpc_server(BROKER_SERVICE, local_options, local_admission)
        self._exchanges = Exchanges(broker, s.max_exchange_commands, settle_s=s.transfer_timeout_s, bounds=streams,
                                    observer=self.metrics)
        broker_service_pb2_grpc.add_BrokerServiceServicer_to_server(
            BrokerServicer(broker, s.unregister_wait_s, gate, data_plane, self._exchanges), local_server)
        if s.listen.startswith("unix:"):
            self._sockets.append(bind_unix(local_server, unix_path(s.listen)))
            listen = s.listen
        else:
            listen = _bind(local_server, s.listen)

        health_listen = self._start_health_listener(s.health_listen) if s.health_listen else ""
        for server in self._servers:
            await server.start()
        self.metrics.watch_loop(asyncio.get_running_loop())
        metrics_listen = self.metrics.serve(s.metrics_listen) if s.metrics_listen else ""
        for servicer, name in zip(self._health, (PEER_SERVICE, BROKER_SERVICE)):
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self._health_listener is not None:
            self._health_listener.serving()
        self.endpoints = Endpoints(listen, peer_listen, peer_address, metrics_listen, health_listen)
        log.info("broker serving", extra={"listen": listen, "peer_listen": peer_listen, "backend": backend.name,
                                          "broker_id": broker.broker_id, "metrics_listen": metrics_listen,
                                          "health_listen": health_listen})
        return self.endpoints

    def _start_health_listener(self, address: str) -> str:
        """The health listener bound and started (NOT_SERVING until startup ends); its address as bound."""
        s = self.settings
        listener = self._health_listener = HealthListener((BROKER_SERVICE, PEER_SERVICE), stall_s=s.health_stall_s,
                                                          threads=s.health_threads, max_calls=s.health_max_calls)
        if address.startswith("unix:"):
            self._sockets.append(bind_unix(listener.server, unix_path(address)))
            bound = address
        else:
            bound = listener.bind(address)
        listener.start()
        self._beating = asyncio.get_running_loop().create_task(self._beat(listener, s.health_beat_s),
                                                               name="health-beat")
        return bound

    @staticmethod
    async def _beat(listener: HealthListener, every_s: float) -> None:
        while True:
            listener.beat()
            await asyncio.sleep(every_s)

    async def serve(self, ready: Callable[[Endpoints], None] | None = None) -> int:
        """Start, call `ready` with the bound endpoints, serve until a signal, shut down. Returns the
        exit status: 0, or 1 when startup failed (what was started is shut down again)."""
        stop = asyncio.Event()
        with capture_signals(stop):
            try:
                endpoints = await self.startup()
            except Exception as exc:
                log.error("startup failed: %s", exc)
                await self.shutdown(0)
                return 1
            if ready is not None:
                ready(endpoints)
            await stop.wait()
            await self.shutdown()
        return 0

    async def shutdown(self, grace_s: float | None = None) -> None:
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        if self._health_listener is not None:
            self._health_listener.draining()
        for servicer in self._health:
            await servicer.enter_graceful_shutdown()
        if self.broker is not None:
            await self.broker.drain(grace)
        stopping = [server.stop(1.0) for server in self._servers]
        if self._beating is not None:
            self._beating.cancel()
        if self._health_listener is not None:  # its stop blocks: not in the loop
            stopping.append(asyncio.to_thread(self._health_listener.stop, 1.0))
        await asyncio.gather(*stopping)
        for socket in self._sockets:  # grpc removes the path it bound, which was renamed
            with contextlib.suppress(OSError):
                if os.stat(socket.path).st_ino == socket.inode:
                    os.unlink(socket.path)
        if self._exchanges is not None:  # the ends of streams gRPC's stop cut, before the broker closes
            await self._exchanges.close()
        if self._peers is not None:
            await self._peers.close()
        if self.broker is not None:
            await self.broker.close()
        await self.metrics.close()
        self._trim.close()
        log.info("broker stopped")
