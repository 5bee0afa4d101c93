"""The frames kvbroker's ranks push to each other over SGLang's ZMQ control sockets.

Where Mooncake's frames carry raw pointers and a transfer-engine session, kvbroker's carry who the
decode rank is (its broker and engine) and what the prefill side cannot learn from the offer its
broker already holds: the decode's cached prefix, which sets where prefill starts sending.

    Registration  once per (decode rank, prefill rank): decode's control endpoint, broker peer
                  address, engine id, attention TP, aux row lengths
    Metadata      once per request, after decode's broker has offered the grant: the room, how many
                  decode ranks take part, decode_prefix_len, whether this prefill rank only pretends,
                  and decode's broker id, which prefill's parts name as their receiver; `aux_only`
                  when decode already holds the whole prompt (no grant: only the aux row moves)
    Outcome       prefill to decode, for an aux-only request alone: its aux rows, or why it failed
                  (the broker has no record of such a request to carry either)

Each frame is a list of byte strings whose first is the tag; `from_frames` refuses anything else.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass

REGISTER_TAG = b"KVBROKER_REGISTER"
METADATA_TAG = b"KVBROKER_METADATA"
OUTCOME_TAG = b"KVBROKER_OUTCOME"
WIRE_VERSION = 1


class WireError(ValueError):
    """A frame that is not a kvbroker frame of this version."""


def _decode(frames: list[bytes], tag: bytes) -> dict:
    if len(frames) != 3 or frames[0] != tag:
        raise WireError(f"expected [{tag!r}, version, body], got {len(frames)} frames starting {frames[:1]!r}")
    if frames[1] != str(WIRE_VERSION).encode():
        raise WireError(f"{tag.decode()} version {frames[1]!r}; this side speaks {WIRE_VERSION}")
    try:
        body = json.loads(frames[2])
    except ValueError as exc:
        raise WireError(f"{tag.decode()} body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise WireError(f"{tag.decode()} body is not an object")
    return body


@dataclass(frozen=True)
class Registration:
    endpoint: str  # decode rank's control address (its ZMQ PULL socket) "ip:port"
    broker_address: str  # decode broker's peer address
    engine_id: str  # decode engine on that broker
    attn_tp_size: int
    engine_rank: int
    aux_item_lens: tuple[int, ...]

    def to_frames(self) -> list[bytes]:
        return [REGISTER_TAG, str(WIRE_VERSION).encode(), json.dumps(asdict(self)).encode()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Registration:
        body = _decode(frames, REGISTER_TAG)
        try:
            return cls(str(body["endpoint"]), str(body["broker_address"]), str(body["engine_id"]),
                       int(body["attn_tp_size"]), int(body["engine_rank"]),
                       tuple(int(x) for x in body["aux_item_lens"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"registration frame: {exc!r}") from None


@dataclass(frozen=True)
class Metadata:
    room: int
    endpoint: str  # the decode rank's control address, as in its registration
    engine_id: str  # the decode engine that granted the pages
    required_dst_info_num: int  # decode ranks that send metadata for this room to this prefill rank
    decode_prefix_len: int  # tokens decode already holds; prefill starts sending after them
    is_dummy: bool  # this prefill rank sends nothing for the room (MLA with prefill TP > decode TP)
    broker_id: str = ""  # decode's broker: prefill's parts name it (receiver_broker_id); "" from older decodes
    aux_only: bool = False  # decode holds every page: no grant was offered; prefill answers with an Outcome

    def to_frames(self) -> list[bytes]:
        return [METADATA_TAG, str(WIRE_VERSION).encode(), json.dumps(asdict(self)).encode()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Metadata:
        body = _decode(frames, METADATA_TAG)
        try:
            return cls(int(body["room"]), str(body["endpoint"]), str(body["engine_id"]),
                       int(body["required_dst_info_num"]), int(body["decode_prefix_len"]), bool(body["is_dummy"]),
                       str(body.get("broker_id", "")), bool(body.get("aux_only", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"metadata frame: {exc!r}") from None


@dataclass(frozen=True)
class Outcome:
    room: int
    aux: bytes = b""  # kvbroker_sglang.aux's encoding of prefill's aux rows, when it succeeded
    failure: str = ""  # why the request failed on prefill; "" when it succeeded

    def to_frames(self) -> list[bytes]:
        body = {"room": self.room, "aux": base64.b64encode(self.aux).decode(), "failure": self.failure}
        return [OUTCOME_TAG, str(WIRE_VERSION).encode(), json.dumps(body).encode()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Outcome:
        body = _decode(frames, OUTCOME_TAG)
        try:
            return cls(int(body["room"]), base64.b64decode(body["aux"], validate=True), str(body["failure"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"outcome frame: {exc!r}") from None
