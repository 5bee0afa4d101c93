"""What a request may carry, from the settings and the proto: the size a method's request may take on
the wire and the bounds of its lists, checked before any handler converts it (Admission, admission.py).

- `RequestLimits.bytes_for(method)`: the most a request of `method` may take, and what says so;
- `RequestLimits.check_lists(request)`: the first list over its bound, as a `Refusal`;
- `PAGE_LISTS`, `LAYER_BUFFER_METHODS`: which methods carry page ids or layer buffers, and how many
  page lists at most, derived from the services' descriptors (`page_lists`): a page-id list counts
  one, a message repeated per component (each component at most once, as the validation rules say)
  counts its lists once per component, and a oneof counts its biggest member;
- `leading_id`: a command stream's command_id read from a message's first bytes, before parsing.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from kvbroker.config import SMALL_MESSAGE_BYTES, page_list_bytes
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb

MAX_LIST_ENTRIES = 1024  # any list of a request other than page ids and layer buffers (components, notices)
LAYER_BUFFER_BYTES = 512  # the most one LayerBuffer message takes: ids, lengths, a segment name or a CUDA handle
COMPONENTS = len([v for v in pb.Component.DESCRIPTOR.values if v.number])  # components a per-component list may name
SERVICES = (bpb.DESCRIPTOR.services_by_name["BrokerService"], ppb.DESCRIPTOR.services_by_name["PeerService"])
# Streams whose messages are commands answered one by one (edge/exchange.py): a refused message is
# handed to the handler, to answer under its command_id, and the stream goes on.
COMMAND_STREAMS = {"/kvbroker.v1.BrokerService/Exchange"}
WHOLE_MESSAGE_METHODS = {"/kvbroker.v1.PeerService/NotifyParts"}  # notices with aux payloads: the port's limit
# Long-lived peer streams (NotifyStream): a stream holds no read slot of PeerReads while it waits for
# its next message, which may be long; instead the streams are bounded in number (StreamQuota), and
# each message to RequestLimits.notice_bytes, so that what they can hold at once is bounded.
NOTICE_STREAMS = {"/kvbroker.v1.PeerService/NotifyStream"}


def page_lists(descriptor: Descriptor) -> int:
    """The most page-id lists one message of `descriptor` may carry (see the module's docstring)."""
    oneofs = [o for o in descriptor.oneofs if not _synthetic(o)]
    in_oneof = {f.name for o in oneofs for f in o.fields}
    return (sum(_field_page_lists(f) for f in descriptor.fields if f.name not in in_oneof)
            + sum(max(_field_page_lists(f) for f in o.fields) for o in oneofs))


def _field_page_lists(field: FieldDescriptor) -> int:
    if field.type == FieldDescriptor.TYPE_UINT32 and field.is_repeated and field.name.endswith("page_ids"):
        return 1
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return 0
    inner = page_lists(field.message_type)
    if inner and field.is_repeated:
        if "component" not in field.message_type.fields_by_name:
            raise ValueError(f"{field.full_name}: a repeated message with page lists that is not one per component; "
                             "its bound cannot be derived")
        return inner * COMPONENTS
    return inner


def _synthetic(oneof) -> bool:
    """proto3's `optional` makes a oneof of one field named after it; it is a plain field."""
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


def _holds(descriptor: Descriptor, found, seen: set[str]) -> bool:
    """Whether a field of `descriptor`, or of a message below it, is one `found` picks."""
    if descriptor.full_name in seen:
        return False
    seen.add(descriptor.full_name)
    return any(found(f) or (f.type == FieldDescriptor.TYPE_MESSAGE and _holds(f.message_type, found, seen))
               for f in descriptor.fields)


def _methods():
    for service in SERVICES:
        for method in service.methods:
            yield f"/{service.full_name}/{method.name}", method.input_type


# Page lists a request of each method may carry, each of up to max_pages_per_request ids; methods
# not named here carry none and take SMALL_MESSAGE_BYTES, but for the layer buffers' and the streams'.
PAGE_LISTS = {path: count for path, message in _methods() if (count := page_lists(message))}
LAYER_BUFFER_METHODS = {path for path, message in _methods()
                        if _holds(message, lambda f: f.name == "layer_buffers", set())}


@dataclass(frozen=True)
class Refusal:
    """What the parser hands the handler instead of a request it refused."""

    code: grpc.StatusCode
    message: str
    kind: str  # the reason, for the log throttle and the refusal counter (REFUSAL_REASONS)
    command_id: int | None = None  # a command stream's message: its command_id, when it could be read


@dataclass(frozen=True)
class RequestLimits:
    """The sizes and counts a request on one port may have; pure, from the settings."""

    port_bytes: int  # grpc's limit on the port
    port_setting: str  # the setting that sets it
    max_pages: int  # max_pages_per_request
    max_layer_buffers: int
    notice_bytes: int = 1 << 20  # one message of a notice stream (server.py: notice_stream_bytes)

    def bytes_for(self, method: str) -> tuple[int, str]:
        """The most a request of `method` may take on the wire, and what says so."""
        if method in NOTICE_STREAMS and self.notice_bytes < self.port_bytes:
            return self.notice_bytes, "1 MiB, or max_aux_bytes plus 64 KiB, per message of a notice stream"
        if method in WHOLE_MESSAGE_METHODS or method in NOTICE_STREAMS:
            return self.port_bytes, self.port_setting
        if method in LAYER_BUFFER_METHODS:
            most, why = self.max_layer_buffers * LAYER_BUFFER_BYTES, f"max_layer_buffers={self.max_layer_buffers}"
        elif method in PAGE_LISTS:
            lists = PAGE_LISTS[method]
            most = lists * page_list_bytes(self.max_pages)
            why = f"{lists} page list{'s' if lists > 1 else ''} of max_pages_per_request={self.max_pages}"
        else:
            most, why = 0, "no page lists"
        most += SMALL_MESSAGE_BYTES
        if most >= self.port_bytes:
            return self.port_bytes, self.port_setting
        return most, why

    def check_lists(self, request: Message) -> Refusal | None:
        """The first list of `request` over its bound, as a refusal; None when all are within."""
        buffers = 0
        stack = [request]
        while stack:
            message = stack.pop()
            nested = _nested_lists(message.DESCRIPTOR)
            for field, value in message.ListFields():
                if field.is_repeated:
                    count = len(value)
                    if field.name.endswith("page_ids"):
                        if count > self.max_pages:
                            return self._too_many(f"{field.name}: {count} page ids exceed the limit of "
                                                  f"{self.max_pages} per request (max_pages_per_request)")
                    elif field.name == "layer_buffers":
                        buffers += count
                        if buffers > self.max_layer_buffers:
                            return self._too_many(f"layer_buffers: more than {self.max_layer_buffers} layer buffers "
                                                  f"in one engine (max_layer_buffers)")
                    elif count > MAX_LIST_ENTRIES:
                        return self._too_many(f"{field.name}: {count} entries exceed the {MAX_LIST_ENTRIES} any "
                                              "list of the API holds")
                    if field.name in nested:
                        stack.extend(value)
                elif field.name in nested:
                    stack.append(value)
        return None

    @staticmethod
    def _too_many(message: str) -> Refusal:
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "too_many_entries")


_NESTED: dict[str, frozenset[str]] = {}


def _nested_lists(descriptor: Descriptor) -> frozenset[str]:
    """Names of the message fields of `descriptor` whose type holds a list somewhere below (cached):
    only those are walked, so a request's layer buffers, say, are counted but never visited."""
    found = _NESTED.get(descriptor.full_name)
    if found is None:
        found = frozenset(f.name for f in descriptor.fields
                          if f.type == FieldDescriptor.TYPE_MESSAGE
                          and _holds(f.message_type, lambda g: g.is_repeated, set()))
        _NESTED[descriptor.full_name] = found
    return found


def leading_id(data: bytes) -> int | None:
    """The command_id of a command stream's message from its first bytes, without parsing the rest:
    field 1 as a varint, which protobuf writes first; None when the message does not start so."""
    if not data or data[0] != 0x08:
        return None
    value = 0
    for i, byte in enumerate(data[1:11]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value if value < 1 << 64 else None
    return None


