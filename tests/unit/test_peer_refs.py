"""PeerRefs, the peer bookkeeping both backends share: a peer goes only when nothing holds or uses it."""

from __future__ import annotations

from kvbroker.backends.base import PeerRefs


def test_a_peer_is_new_on_its_first_connect_only():
    refs = PeerRefs()
    assert refs.connect("a") is True
    assert refs.connect("a") is False
    assert len(refs) == 1 and "a" in refs


def test_a_peer_is_forgotten_when_its_last_connect_is_undone_and_no_use_runs():
    refs = PeerRefs()
    refs.connect("a")
    refs.connect("a")
    use = refs.begin("a")
    assert refs.disconnect("a") and refs.disconnect("a")
    assert not refs.drop_if_idle("a"), "a use still runs"
    assert refs.busy("a")
    refs.end(use)
    assert not refs.busy("a")
    assert refs.drop_if_idle("a")
    assert "a" not in refs


def test_a_disconnect_without_a_connect_changes_nothing():
    refs = PeerRefs()
    assert refs.disconnect("a") is False
    refs.begin("a")
    assert refs.disconnect("a") is False
    assert refs.busy("a")


def test_a_use_of_an_unknown_peer_adds_it_with_its_state():
    refs = PeerRefs(lambda: [])
    use = refs.begin("a")
    assert use.state == [] and use.connects == 0 and use.uses == 1
    assert refs.begin("a") is use
