"""One settings object for the broker: defaults, overridden by KVBROKER_* env vars, overridden by flags.

`Settings` is built once by the CLI (`settings_from_args`, from the flags `add_settings_arguments`
declares) and handed down; nothing reads the environment anywhere else.
"""

from __future__ import annotations

import argparse
import socket
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVBROKER_", frozen=True, extra="forbid")

    listen: str = Field("unix:/run/kvbroker/kvbroker.sock",
                        description="local API address for the inference server: host:port or unix:/path")
    peer_listen: str = Field("0.0.0.0:50052", description="peer API address for other brokers: host:port")
    metrics_listen: str = Field("", description="Prometheus metrics address (HTTP): host:port, port 0 picks a "
                                                "free one; empty: no metrics endpoint")
    health_listen: str = Field("", description="grpc.health.v1 (Check only) on a listener of its own, answered "
                                               "from threads of its own, so that a busy peer flood does not delay "
                                               "the probes: host:port or unix:/path; empty: none (health is on "
                                               "listen and peer_listen too)")
    health_beat_s: float = Field(1.0, gt=0, description="how often the event loop beats into the health listener, "
                                                      "seconds")
    health_stall_s: float = Field(20.0, gt=0, description="the health listener answers NOT_SERVING while the event "
                                                         "loop's last beat is older than this (a wedged loop), "
                                                         "seconds; keep it above health_beat_s and any delay a "
                                                         "flood causes, below the liveness probe's window")
    health_threads: int = Field(2, gt=0, description="threads of the health listener that answer Check")
    health_max_calls: int = Field(64, gt=0, description="calls the health listener holds at once; more are refused "
                                                       "RESOURCE_EXHAUSTED, not queued")
    advertise_host: str = Field("", description="host peers reach this broker by; default: the peer listener's "
                                              "host, or broker_id when it listens on all interfaces")
    broker_id: str = Field(default_factory=socket.gethostname, description="this broker's id in peer handshakes")
    backend: Literal["nixl", "mooncake"] = Field("nixl", description="transfer engine")
    mooncake_protocol: str = Field("tcp", description="Mooncake transport: tcp, or rdma in clusters")
    mooncake_device: str = Field("", description="Mooncake RDMA device names (e.g. mlx5_0), empty for tcp")
    nixl_progress_poll_ms: int = Field(1, ge=1, le=1000, description="NIXL: how long the agent's progress thread "
                                       "sleeps in poll() when no UCX event wakes it, 1-1000 ms. NIXL wakes it at "
                                       "this period besides, against a UCX event it may miss: the longest such a "
                                       "miss delays a receiving broker's progress, against about 900 wake-ups a "
                                       "second of an idle broker at 1")
    peer_tls_cert: str = Field("", description="PEM certificate chain of this broker: served on the peer "
                                              "port and presented to peers (mutual TLS); empty: plaintext")
    peer_tls_key: str = Field("", description="PEM private key of peer_tls_cert")
    peer_tls_ca: str = Field("", description="PEM CA bundle: peers must present a certificate it signed, and "
                                            "peers' servers are verified against it")
    peer_tls_server_name: str = Field("", description="name to verify in peers' certificates instead of the "
                                                     "host dialed (when dialing by IP)")
    peer_allow: str = Field("*", description="comma-separated identity patterns (shell-style, e.g. prefill-*) of the "
                                             "peers that may handshake, offer, claim or write; * admits any")
    peer_rpc_timeout_s: float = Field(5.0, gt=0, description="timeout of one broker-to-broker call, seconds")
    peer_idle_s: float = Field(600.0, gt=0, description="a peer address unused for this long is forgotten: its "
                                                        "handshakes, transfer-engine connection and channel, seconds")
    transfer_timeout_s: float = Field(60.0, gt=0, description="upper bound of one Transfer, seconds")
    default_grant_expiry_s: float = Field(30.0, gt=0, description="grant lifetime when expiry_ms is 0, seconds")
    max_grant_expiry_s: float = Field(600.0, gt=0, description="longest grant a receiver may ask for, seconds")
    offer_wait_s: float = Field(10.0, gt=0, description="how long a Transfer of the offered flow waits for the "
                                                        "receiver's offer to arrive, seconds")
    max_offers: int = Field(65536, gt=0, description="offers from receivers this broker holds at once")
    max_offers_per_peer: int = Field(4096, gt=0, description="of max_offers, how many one peer's offers may hold "
                                                             "(a peer: a certified identity under mutual TLS, else "
                                                             "the host calling, whatever broker ids it claims)")
    max_offer_pages: int = Field(1 << 24, gt=0, description="page ids held in the offers from receivers, all "
                                                            "together")
    max_offer_pages_per_peer: int = Field(1 << 22, gt=0, description="page ids held in one peer's offers")
    max_offer_bytes: int = Field(256 << 20, gt=0, description="bytes the offers from receivers hold (their page "
                                                              "lists, plus 4 KiB each), all together")
    max_offer_bytes_per_peer: int = Field(64 << 20, gt=0, description="bytes one peer's offers hold")
    max_peer_calls: int = Field(2048, gt=0, description="peer API calls that wait (Handshake, RevokeOffer) being "
                                                        "served at once, all peers together")
    max_peer_calls_per_peer: int = Field(512, gt=0, description="of max_peer_calls, how many one peer's calls may "
                                                                "hold (a peer as for max_offers_per_peer)")
    max_aux_bytes: int = Field(65536, ge=0, description="largest aux payload of a last part, bytes")
    max_parts_per_request: int = Field(4096, gt=0, description="parts (chunks) one offered request may have")
    unregister_wait_s: float = Field(10.0, ge=0, description="how long UnregisterEngine waits for writes, seconds")
    shutdown_grace_s: float = Field(20.0, ge=0, description="time in-flight transfers get on SIGTERM, seconds")
    max_pages_per_request: int = Field(1 << 20, gt=0, description="page ids per request and pages per buffer")
    max_message_bytes: int = Field(64 << 20, gt=0, description="largest message of the local API, received or "
                                                              "sent, bytes")
    max_peer_message_bytes: int = Field(0, ge=0, description="largest message of the peer API, received or sent "
                                                             "(a peer's handshake answer too), bytes; 0: what 4 page "
                                                             "lists of max_pages_per_request page ids take, plus "
                                                             "64 KiB")
    peer_notice_stream: bool = Field(True, description="send part notices and grant offers to peer brokers on "
                                                       "one long-lived NotifyStream per peer, and serve it; false: "
                                                       "a NotifyParts call per batch and an OfferGrant call per "
                                                       "offer, and NotifyStream answers UNIMPLEMENTED (as a broker "
                                                       "before it did)")
    max_peer_notice_streams: int = Field(64, gt=0, description="NotifyStream streams the peer port holds at once, "
                                                               "each with up to one message of 1 MiB (or "
                                                               "max_aux_bytes plus 64 KiB) in memory")
    max_notice_streams_per_peer: int = Field(4, gt=0, description="of max_peer_notice_streams, how many one peer "
                                                                  "host may hold")
    max_exchange_commands: int = Field(4096, gt=0, description="commands (parts, grants, watches) one Exchange "
                                                               "stream runs at once; more are refused")
    max_stream_replies: int = Field(256, gt=0, description="replies one stream (Exchange, WatchTransfer, "
                                                           "OpenSession, a peer's NotifyStream) holds for a client "
                                                           "that has not read them; past it the broker reads no more "
                                                           "of that stream's commands until the client reads")
    max_stream_reply_bytes: int = Field(4 << 20, gt=0, description="bytes of the replies one stream holds for a "
                                                                   "client that has not read them (a bigger reply "
                                                                   "alone goes once none is held), bytes")
    stream_stall_s: float = Field(30.0, gt=0, description="a stream whose reply has waited this long to be written "
                                                          "(its client reads nothing) is ended RESOURCE_EXHAUSTED "
                                                          "and all it held freed, seconds")
    max_engines: int = Field(1024, gt=0, description="engines registered at once")
    max_layer_buffers: int = Field(4096, gt=0, description="layer buffers of one engine, at registration and in a "
                                                           "peer's handshake answer")
    max_peer_reads: int = Field(32, gt=0, description="peer API requests received and parsed at once; the others "
                                                      "wait, their requests unread (64 KiB of each buffered), up to "
                                                      "peer_rpc_timeout_s")
    max_reads_per_peer: int = Field(8, gt=0, description="of max_peer_reads, how many one peer host may hold at once")
    max_peer_streams: int = Field(100, gt=0, description="calls one peer connection carries at once (HTTP/2 "
                                                         "concurrent streams); the peer queues more")
    max_peer_connections: int = Field(1024, gt=0, description="connections the peer port holds at once; more are "
                                                              "closed as they are accepted")
    peer_handshake_timeout_s: float = Field(10.0, gt=0, description="a peer connection that has not completed its "
                                                                    "TLS and HTTP/2 handshake by then is closed, "
                                                                    "seconds")
    peer_connection_idle_s: float = Field(300.0, gt=0, description="a peer connection without a call for this long "
                                                                   "is closed, seconds")
    data_port_range: str = Field("", description="the transfer engines' listening ports, low-high (e.g. "
                                                 "20100-20199), in 1024-65535 and outside 32768-60999: "
                                                 "UCX_TCP_PORT_RANGE and UCX_NET_DEVICES (the advertised host's "
                                                 "interface and the RDMA ports) for NIXL, MC_MIN_RPC_PORT and "
                                                 "MC_MAX_RPC_PORT for Mooncake, unless set; empty: the engines' "
                                                 "defaults")
    allow_unprotected_transports: bool = Field(
        False, description="let NIXL run on UCX transports that write and read wherever a peer's remote region "
                           "points (tcp, shared memory: UCX_TLS unset or naming them), which a forged region "
                           "turns into writes outside registered memory; without it the broker refuses to start "
                           "unless UCX_TLS names RDMA or GPU IPC transports only (README.md, Security)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: Literal["auto", "text", "json"] = Field(
        "auto", description="json (one object per line) or text; auto: text when stderr is a terminal, else json")

    @property
    def peer_allow_patterns(self) -> tuple[str, ...]:
        """peer_allow as its patterns; empty entries dropped."""
        return tuple(p.strip() for p in self.peer_allow.split(",") if p.strip()) or ("*",)

    @property
    def advertised_host(self) -> str:
        """The host peers reach this broker by: advertise_host, else the peer listener's host, else (when
        listening on every interface) the broker id, which is the pod's hostname by default."""
        host = self.peer_listen.rpartition(":")[0]
        if self.advertise_host or host in ("", "0.0.0.0", "[::]"):
            return self.advertise_host or self.broker_id
        return host

    @property
    def notice_stream_bytes(self) -> int:
        """The most one message of a notice stream takes: 1 MiB, or max_aux_bytes plus 64 KiB when more."""
        return max(1 << 20, self.max_aux_bytes + SMALL_MESSAGE_BYTES)

    @property
    def peer_message_bytes(self) -> int:
        """max_peer_message_bytes, or when 0 what an OfferGrant's 4 page lists take, plus SMALL_MESSAGE_BYTES."""
        return self.max_peer_message_bytes or 4 * page_list_bytes(self.max_pages_per_request) + SMALL_MESSAGE_BYTES

    @property
    def data_ports(self) -> range | None:
        """data_port_range as a range of ports; None when unset."""
        return parse_port_range(self.data_port_range) if self.data_port_range else None

    @field_validator("data_port_range")
    @classmethod
    def _data_port_range_is_one_the_engines_take(cls, value: str) -> str:
        if value:
            parse_port_range(value)
        return value

    @model_validator(mode="after")
    def _a_stall_outlasts_a_beat(self) -> Settings:
        if self.health_stall_s <= self.health_beat_s:
            raise ValueError(f"health_stall_s ({self.health_stall_s:g}) must exceed health_beat_s "
                             f"({self.health_beat_s:g}): else a live loop reads as stalled between beats")
        return self

    @model_validator(mode="after")
    def _tls_files_come_together(self) -> Settings:
        if bool(self.peer_tls_cert) != bool(self.peer_tls_key):
            raise ValueError("peer_tls_cert and peer_tls_key must be given together")
        if self.peer_tls_ca and not self.peer_tls_cert:
            raise ValueError("peer_tls_ca needs peer_tls_cert and peer_tls_key (mutual TLS)")
        return self


SMALL_MESSAGE_BYTES = 64 << 10  # what a request without page lists or layer buffers may take: ids, reasons, tokens


def page_list_bytes(max_pages: int) -> int:
    """The most one page list of valid ids takes on the wire: each id below max_pages, as a varint,
    plus the field's tag and length."""
    return max_pages * varint_bytes(max_pages - 1) + 16


def varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


KERNEL_EPHEMERAL = range(32768, 61000)  # Linux's default ip_local_port_range: Mooncake refuses a range inside it


def parse_port_range(text: str) -> range:
    """"low-high" as the range of ports it names: 1024 <= low <= high <= 65535, clear of the kernel's
    ephemeral ports (Mooncake falls back to its own 15000-17000 for a range that touches them)."""
    low, sep, high = text.strip().partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"data_port_range: {text!r} is not low-high, e.g. 20100-20199")
    ports = range(int(low), int(high) + 1)
    if not 1024 <= ports.start < ports.stop <= 65536:
        raise ValueError(f"data_port_range: {text!r} must lie in 1024-65535 with low <= high")
    if ports.start < KERNEL_EPHEMERAL.stop and KERNEL_EPHEMERAL.start < ports.stop:
        raise ValueError(f"data_port_range: {text!r} overlaps the kernel's ephemeral ports "
                         f"{KERNEL_EPHEMERAL.start}-{KERNEL_EPHEMERAL.stop - 1}, which Mooncake refuses")
    return ports


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting; unset flags leave the env var or the default in force."""
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind: type[int | float | str] = int if info.annotation is int else float if info.annotation is float else str
        parser.add_argument(flag, dest=name, type=kind, default=None,
                            help=f"{info.description} [env KVBROKER_{name.upper()}]")


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    return Settings(**given)
