"""What Admission checks of a request before a handler sees it, as pure functions: the bytes a method
may take, and the bounds of its lists. The real servers are tests/integration/test_bounds.py's."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from kvbroker.config import SMALL_MESSAGE_BYTES, Settings, page_list_bytes, varint_bytes
from kvbroker.edge.peer_quotas import PeerReads, SlotTimeout, StreamQuota, peer_host
from kvbroker.edge.request_limits import (
    LAYER_BUFFER_BYTES,
    LAYER_BUFFER_METHODS,
    MAX_LIST_ENTRIES,
    NOTICE_STREAMS,
    PAGE_LISTS,
    WHOLE_MESSAGE_METHODS,
    RequestLimits,
    leading_id,
    page_lists,
)
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_client.v1 import peer_service_pb2 as ppb

PEER_BYTES = Settings().peer_message_bytes
LIMITS = RequestLimits(port_bytes=PEER_BYTES, port_setting="max_peer_message_bytes", max_pages=1 << 20,
                       max_layer_buffers=4096)
SERVICES = [(bpb, "BrokerService"), (ppb, "PeerService")]


def methods():
    for module, name in SERVICES:
        for method in module.DESCRIPTOR.services_by_name[name].methods:
            yield f"/kvbroker.v1.{name}/{method.name}", method.input_type


def test_a_page_list_takes_three_bytes_an_id_below_a_million_pages():
    assert varint_bytes(0) == 1 and varint_bytes(127) == 1 and varint_bytes(128) == 2
    assert varint_bytes((1 << 20) - 1) == 3
    assert page_list_bytes(1 << 20) == 3 * (1 << 20) + 16


def test_the_peer_message_limit_is_what_four_page_lists_take_unless_set():
    assert Settings().peer_message_bytes == 4 * page_list_bytes(1 << 20) + SMALL_MESSAGE_BYTES
    assert Settings(max_pages_per_request=1000).peer_message_bytes == 4 * page_list_bytes(1000) + SMALL_MESSAGE_BYTES
    assert Settings(max_peer_message_bytes=5 << 20).peer_message_bytes == 5 << 20


def test_every_method_that_carries_page_ids_layer_buffers_or_payloads_has_its_size_named():
    """A method missing from the tables takes SMALL_MESSAGE_BYTES: one that carries more must be there."""
    for path, message in methods():
        big = _carries_big(message, set())
        named = (path in PAGE_LISTS or path in LAYER_BUFFER_METHODS or path in WHOLE_MESSAGE_METHODS
                 or path in NOTICE_STREAMS)
        assert named == bool(big), f"{path}: carries {big or 'nothing big'}"


def _carries_big(message, seen: set[str]) -> set[str]:
    if message.full_name in seen:
        return set()
    seen.add(message.full_name)
    found = set()
    for field in message.fields:
        if field.name.endswith("page_ids") or field.name == "layer_buffers" or (
                field.type == FieldDescriptor.TYPE_BYTES and field.name == "aux"):
            found.add(field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            found |= _carries_big(field.message_type, seen)
    return found


def test_the_page_list_table_is_derived_from_the_proto():
    """A page-id list counts one, a list per component counts once per component (four of them), a
    oneof its biggest member: the counts the bounds were first written with by hand."""
    assert PAGE_LISTS == {
        "/kvbroker.v1.BrokerService/ExpectTransfer": 5,  # dst_page_ids, or pages: one list per component
        "/kvbroker.v1.BrokerService/Transfer": 6,  # src_page_ids and dst_page_ids, or one source list per component
        "/kvbroker.v1.BrokerService/Exchange": 6,  # each message: one Transfer (its most) or one ExpectTransfer
        "/kvbroker.v1.PeerService/ClaimGrant": 1,
        "/kvbroker.v1.PeerService/OfferGrant": 4,
        "/kvbroker.v1.PeerService/NotifyStream": 4,  # an offer (its size is the notice stream's bound)
    }
    assert LAYER_BUFFER_METHODS == {"/kvbroker.v1.BrokerService/RegisterEngine"}
    assert page_lists(pb.ComponentPages.DESCRIPTOR) == 1 and page_lists(bpb.TransferStatus.DESCRIPTOR) == 0


def test_a_method_without_page_lists_takes_small_requests():
    assert LIMITS.bytes_for("/kvbroker.v1.PeerService/Handshake") == (SMALL_MESSAGE_BYTES, "no page lists")
    assert LIMITS.bytes_for("/grpc.health.v1.Health/Check")[0] == SMALL_MESSAGE_BYTES


def test_a_method_with_page_lists_takes_what_they_take_within_the_ports_limit():
    most, why = LIMITS.bytes_for("/kvbroker.v1.PeerService/ClaimGrant")
    assert most == page_list_bytes(1 << 20) + SMALL_MESSAGE_BYTES and "max_pages_per_request" in why
    assert LIMITS.bytes_for("/kvbroker.v1.PeerService/OfferGrant") == (PEER_BYTES, "max_peer_message_bytes")
    assert LIMITS.bytes_for("/kvbroker.v1.BrokerService/Transfer") == (PEER_BYTES, "max_peer_message_bytes")
    assert LIMITS.bytes_for("/kvbroker.v1.PeerService/NotifyParts") == (PEER_BYTES, "max_peer_message_bytes")


def test_a_notice_streams_message_takes_a_mebibyte_or_the_aux_bound_but_never_more_than_the_port():
    assert Settings().notice_stream_bytes == 1 << 20
    assert Settings(max_aux_bytes=4 << 20).notice_stream_bytes == (4 << 20) + SMALL_MESSAGE_BYTES
    most, why = LIMITS.bytes_for("/kvbroker.v1.PeerService/NotifyStream")
    assert most == 1 << 20 and "notice stream" in why
    small_port = RequestLimits(1000, "max_peer_message_bytes", 1 << 20, 4096, notice_bytes=1 << 20)
    assert small_port.bytes_for("/kvbroker.v1.PeerService/NotifyStream") == (1000, "max_peer_message_bytes")


def test_notice_streams_are_bounded_in_all_and_per_host_and_given_back():
    quota = StreamQuota(total=3, per_host=2)
    assert quota.enter("a") is None and quota.enter("a") is None
    assert "max_notice_streams_per_peer" in quota.enter("a")
    assert quota.enter("b") is None
    assert "max_peer_notice_streams" in quota.enter("c")
    quota.leave("a")
    assert quota.enter("c") is None
    assert "max_peer_notice_streams" in quota.enter("a")


def test_registration_takes_what_its_layer_buffers_may():
    most, why = LIMITS.bytes_for("/kvbroker.v1.BrokerService/RegisterEngine")
    assert most == 4096 * LAYER_BUFFER_BYTES + SMALL_MESSAGE_BYTES and "max_layer_buffers" in why
    biggest = pb.LayerBuffer(layer_id=2**32 - 1, role=pb.BUFFER_ROLE_V, length=2**64 - 1, item_len=2**64 - 1,
                             memory=pb.MemoryRef(shared_memory=pb.SharedMemoryRef(name="x" * 255, offset=2**64 - 1)))
    cuda = pb.LayerBuffer(layer_id=2**32 - 1, role=pb.BUFFER_ROLE_V, length=2**64 - 1, item_len=2**64 - 1,
                          memory=pb.MemoryRef(cuda_ipc=pb.CudaIpcRef(handle=b"\xff" * 64, device=2**32 - 1,
                                                                     offset=2**64 - 1, allocation_size=2**64 - 1)))
    entry = pb.ComponentSpec(layer_buffers=[biggest]).ByteSize()
    assert max(entry, pb.ComponentSpec(layer_buffers=[cuda]).ByteSize()) <= LAYER_BUFFER_BYTES


def test_lists_within_their_bounds_pass():
    request = ppb.OfferGrantRequest(pages=[pb.ComponentPages(component=c, page_ids=[1, 2, 3]) for c in (1, 2, 3, 4)])
    assert LIMITS.check_lists(request) is None


def test_a_page_list_over_max_pages_is_refused_naming_the_setting():
    limits = RequestLimits(1 << 30, "max_message_bytes", max_pages=10, max_layer_buffers=4)
    refusal = limits.check_lists(ppb.OfferGrantRequest(pages=[pb.ComponentPages(component=1, page_ids=range(11))]))
    assert refusal.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "page_ids: 11 page ids exceed the limit of 10 per request (max_pages_per_request)" == refusal.message
    assert limits.check_lists(bpb.TransferRequest(src_page_ids=range(10), dst_page_ids=range(11))) is not None


def test_layer_buffers_count_across_an_engines_components():
    limits = RequestLimits(1 << 30, "max_message_bytes", max_pages=10, max_layer_buffers=4)
    two = [pb.LayerBuffer(layer_id=i) for i in range(2)]
    within = bpb.RegisterEngineRequest(components=[pb.ComponentSpec(layer_buffers=two)] * 2)
    assert limits.check_lists(within) is None
    over = bpb.RegisterEngineRequest(components=[pb.ComponentSpec(layer_buffers=two)] * 2 + [
        pb.ComponentSpec(layer_buffers=two[:1])])
    assert "max_layer_buffers" in limits.check_lists(over).message
    answer = ppb.HandshakeResponse(engine=ppb.PeerEngine(components=[ppb.PeerComponent(
        layer_buffers=[ppb.PeerLayerBuffer(layer_id=i) for i in range(5)])]))
    assert "max_layer_buffers" in limits.check_lists(answer).message


def test_any_other_list_holds_at_most_max_list_entries():
    assert LIMITS.check_lists(ppb.ClaimGrantRequest(components=[1] * MAX_LIST_ENTRIES)) is None
    refusal = LIMITS.check_lists(ppb.ClaimGrantRequest(components=[1] * (MAX_LIST_ENTRIES + 1)))
    assert refusal.message.startswith("components: 1025 entries")


@pytest.mark.parametrize(("peer", "host"), [("ipv4:10.0.0.7:41234", "ipv4:10.0.0.7"), ("ipv6:[::1]:5", "ipv6:[::1]"),
                                            ("unix:/run/kvbroker/kvbroker.sock", "unix:/run/kvbroker/kvbroker.sock")])
def test_calls_from_one_host_share_its_name_whatever_their_port(peer, host):
    assert peer_host(peer) == host


class Context:
    """What PeerReads needs of a call: its next request, which comes when the test says."""

    def __init__(self) -> None:
        self.request = asyncio.get_running_loop().create_future()
        self.reading = asyncio.Event()  # set once it holds a slot and reads

    async def read(self):
        self.reading.set()
        return await self.request


async def test_a_host_holds_at_most_its_share_of_the_reads_and_the_others_wait_their_turn():
    reads = PeerReads(reads=3, per_host=2, wait_s=5)
    greedy = [Context() for _ in range(3)]
    tasks = [asyncio.create_task(reads.read(c, "ipv4:10.0.0.1")) for c in greedy]
    other = Context()
    other_task = asyncio.create_task(reads.read(other, "ipv4:10.0.0.2"))
    other.request.set_result("other's")
    assert await asyncio.wait_for(other_task, 5) == "other's"  # the greedy host could not take the third slot
    assert reads.waiting("ipv4:10.0.0.1") == 3
    for n, context in enumerate(greedy):
        context.request.set_result(n)
    assert await asyncio.wait_for(asyncio.gather(*tasks), 5) == [0, 1, 2]
    assert reads.waiting("ipv4:10.0.0.1") == 0 and not reads._hosts


async def test_a_call_that_gets_no_turn_within_the_wait_is_refused_and_one_that_sends_nothing_times_out():
    reads = PeerReads(reads=1, per_host=1, wait_s=0.2)
    silent = Context()  # never sends its request
    holder = asyncio.create_task(reads.read(silent, "ipv4:10.0.0.1"))
    await asyncio.wait_for(silent.reading.wait(), 5)
    with pytest.raises(SlotTimeout):
        await reads.read(Context(), "ipv4:10.0.0.2")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(holder, 5)
    assert not reads._hosts


def test_a_command_streams_message_names_its_command_id_in_its_first_bytes():
    """A refused Exchange message is answered under its command_id, read without parsing the message."""
    for command_id in (0, 1, 127, 128, 300, 1 << 40, (1 << 64) - 1):
        message = bpb.ExchangeRequest(command_id=command_id, transfer=bpb.TransferRequest(request_id="r"))
        expected = command_id if command_id else None  # 0 is not written: such a refusal ends the stream
        assert leading_id(message.SerializeToString()) == expected
    assert leading_id(b"") is None and leading_id(b"\x1a\x00") is None and leading_id(b"\x08\xff") is None
