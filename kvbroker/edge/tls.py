"""The peer port's TLS files, re-read when they change: certificates rotate without a restart.

cert-manager (its csi-driver, or a Secret volume) replaces a pod's certificate files before they
expire; a broker that read them once would serve, and dial with, the expired pair until restarted.
`PeerTls` holds the current pair (and CA) and looks at the files again at most every CHECK_S:
- the peer server's credentials are grpc's dynamic ones, whose fetcher grpc calls before each new
  connection's handshake: a change is served from the next connection on;
- the peer clients ask `channel_credentials()` for each channel they open, with a generation
  number: a channel made under an older generation is replaced (peers/channels.py), so that a
  reconnection never presents the old certificate.
A change (of a file's inode, size or mtime) is taken once no file has been modified for SETTLE_S,
so that a writer replacing the files one by one is never read halfway (a new certificate beside
the old key). Connections already established keep the pair they were made with.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often the files are looked at, at most
SETTLE_S = 1.0  # how long the files must have been left alone before a change is taken

Signature = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class TlsPair:
    cert: bytes
    key: bytes
    ca: bytes | None


class PeerTls:
    """The broker's certificate, key and CA (the CA optional: without it peers are not asked for
    certificates), as read from their files; thread-safe (grpc calls the fetcher on its own threads)."""

    def __init__(self, cert: str, key: str, ca: str = "", clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._paths = tuple(p for p in (cert, key, ca) if p)
        self._has_ca = bool(ca)
        self._clock = clock
        self._wall = wall  # the files' mtimes are wall-clock times
        self._lock = threading.Lock()
        self._signature = self._stat()
        self.pair = self._read()  # raises OSError when a file cannot be read: the broker does not start
        self.generation = 1
        self._served = 1  # the generation the peer server serves
        self._channel: tuple[int, grpc.ChannelCredentials] | None = None
        self._checked = clock()

    def _stat(self) -> Signature:
        out = []
        for path in self._paths:
            st = os.stat(path)  # follows the symlinks a Secret volume swaps
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def _read(self) -> TlsPair:
        data = [open(path, "rb").read() for path in self._paths]
        return TlsPair(data[0], data[1], data[2] if self._has_ca else None)

    def refresh(self) -> bool:
        """Look at the files (at most every CHECK_S); True when this call took a settled change."""
        with self._lock:
            now = self._clock()
            if now - self._checked < CHECK_S:
                return False
            self._checked = now
            try:
                signature = self._stat()
            except OSError as exc:  # mid-replacement, or gone: keep what we have
                log.warning("peer TLS files unreadable, keeping the current ones: %s", exc)
                return False
            if signature == self._signature:
                return False
            if self._wall() - max(mtime for *_, mtime in signature) / 1e9 < SETTLE_S:
                return False  # still being written, perhaps: looked at again on a later check
            try:
                pair = self._read()
            except OSError as exc:
                log.warning("peer TLS files unreadable, keeping the current ones: %s", exc)
                return False
            if self._stat() != signature:  # replaced while read
                return False
            self.pair, self._signature = pair, signature
            self.generation += 1
            log.info("peer TLS files changed: new connections use them", extra={"generation": self.generation})
            return True

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._server_configuration(), self._fetch,
                                                   require_client_authentication=self._has_ca)

    def _server_configuration(self) -> grpc.ServerCertificateConfiguration:
        pair = self.pair
        return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert)], root_certificates=pair.ca)

    def _current(self) -> tuple[int, TlsPair]:
        self.refresh()
        with self._lock:
            return self.generation, self.pair

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher, before each new connection's handshake: a new configuration, or None."""
        try:
            generation, pair = self._current()
            with self._lock:
                if generation == self._served:
                    return None
                self._served = generation
            return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert)], root_certificates=pair.ca)
        except Exception:  # an exception here would fail the handshake: keep serving the current pair
            log.exception("could not reload the peer TLS files")
            return None

    def channel_credentials(self) -> tuple[int, grpc.ChannelCredentials]:
        """The credentials a new peer channel uses, with their generation (made once per generation)."""
        generation, pair = self._current()
        made = self._channel
        if made is None or made[0] != generation:
            made = self._channel = (generation, grpc.ssl_channel_credentials(
                root_certificates=pair.ca, private_key=pair.key, certificate_chain=pair.cert))
        return made
