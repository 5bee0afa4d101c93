"""Who gets which reply on the client's Exchange (kvbroker_client.exchange._Waiters), without a broker:
a transfer with end_watches whose reply is SUCCEEDED is the last message of the stream's watches of
its request, and nothing else is. The broker's side of the rule, on real brokers, is
tests/integration/test_exchange.py."""

from __future__ import annotations

import asyncio

from kvbroker_client.exchange import _Waiters
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb

KEY = ("prefill-0", "r1")


def waiters_with_a_watch_and_a_part() -> tuple[_Waiters, asyncio.Queue, asyncio.Queue, asyncio.Future]:
    waiters = _Waiters()
    mine, other = asyncio.Queue(), asyncio.Queue()
    waiters.watches.update({1: mine, 2: other})
    waiters.watched.update({1: KEY, 2: ("prefill-0", "r2")})
    part = asyncio.get_running_loop().create_future()
    waiters.pending[3] = part
    waiters.enders[3] = KEY
    return waiters, mine, other, part


def reply(state: int) -> bpb.ExchangeResponse:
    return bpb.ExchangeResponse(command_id=3, transfer=bpb.TransferResponse(
        status=bpb.TransferStatus(request_id="r1", engine_id="prefill-0", state=state, parts=1)))


async def test_a_succeeded_part_ends_the_watches_of_its_request_before_its_caller_sees_it():
    waiters, mine, other, part = waiters_with_a_watch_and_a_part()
    waiters.hand(reply(pb.TRANSFER_STATE_SUCCEEDED))
    end = mine.get_nowait()
    assert (end.command_id, end.watch.status.state, end.watch.status.parts) == (1, pb.TRANSFER_STATE_SUCCEEDED, 1)
    assert other.empty()  # another request's watch goes on
    assert part.result().transfer.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert not waiters.enders and not waiters.pending


async def test_a_part_that_did_not_end_the_request_leaves_the_watches_alone():
    for answer in (reply(pb.TRANSFER_STATE_TRANSFERRING),
                   bpb.ExchangeResponse(command_id=3, error=bpb.ExchangeError(code=9, message="refused"))):
        waiters, mine, other, part = waiters_with_a_watch_and_a_part()
        waiters.hand(answer)
        assert mine.empty() and other.empty()
        assert part.result() == answer and not waiters.enders
