"""The key NIXL metadata is loaded under: the agent's name and a digest of the whole metadata, so that a
bad copy of a real broker's metadata can never take that broker's remote-agent state."""

from __future__ import annotations

import pytest

from kvbroker.backends.base import TransferFailed
from kvbroker.backends.nixl import AGENT_HEADER, keyed_metadata


def metadata(name: bytes, rest: bytes = b"|Conns\x08\x00\x00\x00\x00\x00\x00\x00abcdefgh|t") -> bytes:
    return AGENT_HEADER + len(name).to_bytes(8, "little") + name + rest


def test_metadata_is_renamed_to_its_key_and_keeps_the_rest():
    key, keyed = keyed_metadata(metadata(b"decode-7-1-5e1f"))
    assert key.startswith(b"decode-7-1-5e1f#") and len(key) == len(b"decode-7-1-5e1f#") + 16
    assert keyed == metadata(key)


def test_the_same_metadata_has_the_same_key_and_any_other_copy_another():
    real = metadata(b"decode-7")
    assert keyed_metadata(real)[0] == keyed_metadata(bytes(real))[0]
    assert keyed_metadata(real[:-1])[0] != keyed_metadata(real)[0]  # truncated: the name is the same
    assert keyed_metadata(real[:-1])[0].split(b"#")[0] == b"decode-7"


@pytest.mark.parametrize("bad", [b"", b"nixlSerDes|Agent", AGENT_HEADER + b"\x05\x00\x00\x00\x00\x00\x00\x00ab",
                                 AGENT_HEADER + (0).to_bytes(8, "little") + b"|",
                                 AGENT_HEADER + (5000).to_bytes(8, "little") + b"x" * 5000 + b"|",
                                 b"127.0.0.1:1234", metadata(b"a", rest=b"Conns")])
def test_bytes_that_do_not_open_with_an_agent_name_are_refused_before_nixl_sees_them(bad):
    with pytest.raises(TransferFailed, match="does not open with an agent name"):
        keyed_metadata(bad)
