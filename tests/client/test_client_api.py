"""The client's parameters say what they are: `dst_pages` (expect_transfer) and `src_pages`
(transfer_part), `last` with no default; the old names still work for a release, each with a
DeprecationWarning. Pure argument mapping: the request each call would send is captured."""

from __future__ import annotations

import warnings

import pytest

from kvbroker_client.client import BrokerClient
from kvbroker_client.errors import InvalidArgument
from kvbroker_client.model import Component
from kvbroker_client.v1 import broker_service_pb2 as bpb

MAIN, DENSE = Component.MAIN_KV, Component.MINIMAX_DENSE_KV


@pytest.fixture
async def sent():
    """A client whose calls are captured instead of sent."""
    client = BrokerClient("127.0.0.1:9")  # never dialled
    requests = []

    status = bpb.TransferStatus(role=1, state=1)  # any valid status: what is sent is under test

    async def unary(method, request, deadline, **kwargs):
        requests.append(request)
        if method == "ExpectTransfer":
            return bpb.ExpectTransferResponse(status=status)
        return bpb.TransferResponse(status=status)

    client._unary = unary
    yield client, requests
    await client.close()


async def test_dst_pages_and_src_pages_name_the_page_lists_and_do_not_warn(sent):
    client, requests = sent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await client.expect_transfer("d", "r", {MAIN: [1, 2], DENSE: [3]}, sender_address="p:1")
        await client.transfer_part("p", "r", {MAIN: [7, 8]}, dst_offsets={MAIN: 0}, last=False)
        await client.expect_transfer("d", "r2", dst_page_ids=[4, 5])
    grant, part, claimed = requests
    assert [(p.component, list(p.page_ids)) for p in grant.pages] == [(int(MAIN), [1, 2]), (int(DENSE), [3])]
    assert part.more_parts and [list(p.src_page_ids) for p in part.pages] == [[7, 8]]
    assert list(claimed.dst_page_ids) == [4, 5] and not claimed.pages


async def test_the_old_names_still_work_and_warn(sent):
    client, requests = sent
    with pytest.warns(DeprecationWarning, match="dst_pages") as warned:
        await client.expect_transfer("d", "r", pages={MAIN: [1, 2]}, sender_address="p:1")
    assert warned[0].filename == __file__  # the warning names the caller's line, not the client's
    with pytest.warns(DeprecationWarning, match="dst_page_ids"):
        await client.expect_transfer("d", "r2", [4, 5])
    with pytest.warns(DeprecationWarning, match="src_pages"):
        await client.transfer_part("p", "r", pages={MAIN: [7]}, last=False)
    with pytest.warns(DeprecationWarning, match="last=True or last=False"):
        await client.transfer_part("p", "r", {MAIN: [9]})
    offered, claimed, part, last = requests
    assert [list(p.page_ids) for p in offered.pages] == [[1, 2]]
    assert list(claimed.dst_page_ids) == [4, 5]
    assert part.more_parts and [list(p.src_page_ids) for p in part.pages] == [[7]]
    assert not last.more_parts  # the old default: the last part


async def test_a_page_list_given_twice_is_refused(sent):
    client, _ = sent
    with pytest.raises(InvalidArgument, match="not both"), pytest.warns(DeprecationWarning):
        await client.expect_transfer("d", "r", {MAIN: [1]}, pages={MAIN: [1]})
    with pytest.raises(InvalidArgument, match="src_pages"):
        await client.transfer_part("p", "r", last=True)
