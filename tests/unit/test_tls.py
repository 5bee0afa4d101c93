"""PeerTls: the peer TLS files re-read when they change, once the change has settled."""

from __future__ import annotations

import os

import pytest
import trustme

from kvbroker.edge import tls
from kvbroker.edge.tls import PeerTls


class Clock:
    """The monotonic clock (CHECK_S) and the wall clock the files' mtimes are read against."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.wall = 2_000_000_000.0

    def __call__(self) -> float:
        return self.now

    def later(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds


def write_pair(directory, ca: trustme.CA, name: str, mtime: float) -> dict[str, str]:
    """Certificate, key and CA for `name`, each replaced atomically (as a Secret volume does), all
    modified at `mtime`."""
    cert = ca.issue_cert(name)
    paths = {kind: str(directory / f"{kind}.pem") for kind in ("cert", "key", "ca")}
    for kind, blob in (("cert", cert.cert_chain_pems[0]), ("key", cert.private_key_pem), ("ca", ca.cert_pem)):
        blob.write_to_path(paths[kind] + ".new")
        os.utime(paths[kind] + ".new", (mtime, mtime))
        os.replace(paths[kind] + ".new", paths[kind])
    return paths


@pytest.fixture
def clock():
    return Clock()


def make(directory, clock: Clock) -> PeerTls:
    paths = write_pair(directory, trustme.CA(), "decode-0", clock.wall - 3600)
    return PeerTls(paths["cert"], paths["key"], paths["ca"], clock=clock, wall=lambda: clock.wall)


def test_a_change_is_taken_once_the_files_were_left_alone_for_the_settle_time(tmp_path, clock):
    peer_tls = make(tmp_path, clock)
    first = peer_tls.pair
    assert peer_tls.channel_credentials()[0] == 1

    clock.later(tls.CHECK_S)
    write_pair(tmp_path, trustme.CA(), "decode-0", clock.wall)
    assert not peer_tls.refresh() and peer_tls.generation == 1  # written just now: perhaps not all yet
    clock.later(tls.CHECK_S / 2)
    assert not peer_tls.refresh()  # too soon to look again
    clock.later(tls.SETTLE_S)
    assert peer_tls.refresh()
    assert peer_tls.generation == 2 and peer_tls.pair != first
    assert peer_tls.pair.ca == open(tmp_path / "ca.pem", "rb").read()
    generation, credentials = peer_tls.channel_credentials()
    assert generation == 2 and peer_tls.channel_credentials()[1] is credentials  # made once per generation


def test_files_replaced_long_ago_are_taken_at_the_first_look(tmp_path, clock):
    peer_tls = make(tmp_path, clock)
    write_pair(tmp_path, trustme.CA(), "decode-0", clock.wall - 60)
    clock.later(tls.CHECK_S)
    assert peer_tls.refresh() and peer_tls.generation == 2


def test_files_still_being_written_are_not_taken(tmp_path, clock):
    peer_tls = make(tmp_path, clock)
    for _ in range(3):  # rewritten before each look
        clock.later(tls.CHECK_S + tls.SETTLE_S)
        write_pair(tmp_path, trustme.CA(), "decode-0", clock.wall)
        assert not peer_tls.refresh()
    assert peer_tls.generation == 1


def test_missing_files_keep_the_current_pair(tmp_path, clock):
    peer_tls = make(tmp_path, clock)
    os.unlink(tmp_path / "key.pem")
    for _ in range(2):
        clock.later(tls.SETTLE_S + tls.CHECK_S)
        assert not peer_tls.refresh()
    assert peer_tls.generation == 1 and peer_tls.pair.key


def test_the_server_gets_each_new_generation_once_even_when_a_client_took_it_first(tmp_path, clock):
    peer_tls = make(tmp_path, clock)
    assert peer_tls._fetch() is None  # nothing new to serve
    write_pair(tmp_path, trustme.CA(), "decode-0", clock.wall - 60)
    clock.later(tls.CHECK_S)
    assert peer_tls.channel_credentials()[0] == 2  # the client side took the change
    assert peer_tls._fetch() is not None  # the server still learns of it
    assert peer_tls._fetch() is None


def test_unreadable_files_at_start_stop_the_broker(tmp_path):
    with pytest.raises(OSError):
        PeerTls(str(tmp_path / "no-cert.pem"), str(tmp_path / "no-key.pem"))
