"""Two requests at the edges of the offered flow, on real brokers, in a fixed order.

    decode holds the whole prompt (its radix cache has every token: the same prompt again): no page
        to grant, so SGLang's zero-page last chunk moves the aux row alone (kvbroker_sglang.aux_only),
        as SGLang's Mooncake backend does; an abort on either side ends the other at once
    prefill ends a request (its abort) before decode's offer reached the prefill broker: the late
        offer is cancelled when decode's metadata frame comes, and decode fails then, not at
        SGLang's waiting timeout
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from kvbroker_client import BrokerClient, NotFound
from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender
from tests.support import sglang_ranks as ranks
from tests.support.sglang_pair import (
    DECODE_AUX,
    PREFILL_AUX,
    Pair,
    Watched,
    _rooms,
    failure,
    make_pair,
    new_request,
    polls,
    send_decode_metadata,
)

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 37  # what decode's radix cache holds of the prompt: all of it
# A failure must reach the other side on its own, well before SGLang's waiting timeout (300 s): a
# wait this long is a hang, not a slow machine.
PROMPT_FAILURE_S = 30.0


async def llama_pair(sglang_ranks, prefill_listen: str, decode_listen: str) -> Pair:
    """A prefill and a decode rank of a Llama-shaped model: SGLang's MHA pool, no state components."""
    await asyncio.to_thread(sglang_ranks.bootstrap_server)
    prefill_rank = ranks.rank_kv_args(ranks.mha_pool(21, start_layer=0, end_layer=2), num_hidden_layers=2)
    decode_rank = ranks.rank_kv_args(ranks.mha_pool(22, start_layer=0, end_layer=2), num_hidden_layers=2)
    assert not prefill_rank.kv_args.state_types
    prefill = await asyncio.to_thread(sglang_ranks.manager, prefill_listen, "prefill", prefill_rank)
    decode = await asyncio.to_thread(sglang_ranks.manager, decode_listen, "decode", decode_rank)
    bootstrap = f"127.0.0.1:{sglang_ranks.process.bootstrap_port}"
    assert await asyncio.to_thread(decode.try_ensure_parallel_info, bootstrap)
    return Pair(prefill, decode, prefill_rank, decode_rank, bootstrap)


def whole_prompt_held(pair: Pair, room: int) -> tuple[Watched, Watched]:
    """Both bootstrap queues; decode's metadata names no page and a prefix of the whole prompt."""
    sender = Watched(KvbrokerKVSender(pair.prefill, pair.bootstrap, room))
    receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, room))
    sender.poll(), receiver.poll()
    receiver.side.init(0)
    receiver.until(*polls("WaitingForInput"))
    # decode.py: kv_indices = req_to_token[total_prefix_len:origin_input_len], empty; no state types
    receiver.side.send_metadata(np.empty(0, dtype=np.int32), DECODE_AUX, [], decode_prefix_len=PROMPT_TOKENS)
    assert sender.until(*polls("WaitingForInput", "Failed")) == polls("WaitingForInput")[0], failure(sender)
    return sender, receiver


def fill_aux(pair: Pair, room: int) -> None:
    metadata = pair.prefill_rank.metadata
    metadata.output_ids[PREFILL_AUX] = torch.arange(16, dtype=torch.int32) + room % 1000
    metadata.cached_tokens[PREFILL_AUX, 0] = PROMPT_TOKENS
    metadata.bootstrap_room[PREFILL_AUX, 0] = room


async def no_record(pair: Pair, brokers, room: int) -> None:
    for broker, manager in zip(brokers, (pair.prefill, pair.decode)):
        async with await BrokerClient.connect(broker.listen) as client:
            with pytest.raises(NotFound):
                await client.wait(manager.engine_id, str(room), timeout=10)


async def test_a_request_whose_whole_prompt_decode_holds_moves_its_aux_row_alone(sglang_ranks, engine_brokers):
    pair = await llama_pair(sglang_ranks, *(b.listen for b in engine_brokers))
    room = next(_rooms)

    def run():
        sender, receiver = whole_prompt_held(pair, room)
        assert sender.side.pop_decode_prefix_len() == PROMPT_TOKENS  # prefill.py: start sending after it
        sender.side.init(0, PREFILL_AUX)  # prefill.py: kv_to_page_num(len(prompt) - prefix) = 0 pages
        fill_aux(pair, room)
        sender.side.send(np.empty(0, dtype=np.int32))  # the zero-page last chunk
        return (sender.until(*polls("Success", "Failed"), timeout=PROMPT_FAILURE_S),
                receiver.until(*polls("Success", "Failed"), timeout=PROMPT_FAILURE_S), sender, receiver)

    sent, received, sender, receiver = await asyncio.to_thread(run)
    assert (sent, received) == tuple(polls("Success", "Success")), (sender.seen, receiver.seen)
    assert polls("Transferring")[0] not in sender.seen + receiver.seen  # nothing writes into any page
    for mine, theirs in zip(pair.decode_rank.metadata.get_buf(DECODE_AUX),
                            pair.prefill_rank.metadata.get_buf(PREFILL_AUX)):
        if theirs is not None:
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert int(pair.decode_rank.metadata.bootstrap_room[DECODE_AUX, 0]) == room  # decode's room check
    await no_record(pair, engine_brokers, room)  # no grant, no Transfer: the brokers never saw it
    sender.side.clear(), receiver.side.clear()
    assert room not in pair.prefill._rooms and room not in pair.decode._rooms


async def test_either_sides_abort_of_an_aux_only_request_fails_the_other_at_once(sglang_ranks, broker_pair):
    pair = await llama_pair(sglang_ranks, *(b.listen for b in broker_pair))

    def prefill_aborts():
        sender, receiver = whole_prompt_held(pair, next(_rooms))
        sender.side.abort()
        sender.until(*polls("Failed"))
        assert receiver.until(*polls("Failed", "Success"), timeout=PROMPT_FAILURE_S) == polls("Failed")[0]
        return failure(receiver)

    def decode_aborts():
        sender, receiver = whole_prompt_held(pair, next(_rooms))
        receiver.side.abort()
        receiver.until(*polls("Failed"))
        assert sender.until(*polls("Failed", "Success"), timeout=PROMPT_FAILURE_S) == polls("Failed")[0]
        return failure(sender)

    assert "abort" in (await asyncio.to_thread(prefill_aborts)).failure_reason.lower()
    assert "abort" in (await asyncio.to_thread(decode_aborts)).failure_reason.lower()


@pytest.mark.parametrize("cleared", [True, False], ids=["sender-cleared", "sender-not-yet-cleared"])
async def test_a_prefill_abort_before_decodes_offer_came_fails_decode_when_the_offer_comes(sglang_ranks,
                                                                                           engine_brokers, cleared):
    """The order: SGLang makes the prefill sender, prefill aborts it (its cancel finds no record on the
    prefill broker: decode has offered nothing yet), and clears it or not yet; only then does decode's
    offer reach the prefill broker and its metadata frame the prefill rank."""
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(61)

    def run():
        sender = Watched(KvbrokerKVSender(pair.prefill, pair.bootstrap, request.room))
        sender.poll()
        sender.side.abort()  # e.g. the client went away while the request waited in prefill's queue
        sender.until(*polls("Failed"))
        cancelled = pair.prefill.request_of(request.room)
        assert cancelled is not None and cancelled.cancelled
        cancelled.wait_quiesced(PROMPT_FAILURE_S)  # answered: the broker had nothing to cancel then
        if cleared:
            sender.side.clear()
        receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, request.room))
        send_decode_metadata(pair, request, receiver)
        assert receiver.until(*polls("Failed", "Success"), timeout=PROMPT_FAILURE_S) == polls("Failed")[0], \
            f"decode never learned that prefill had ended the request (saw {receiver.seen})"
        if not cleared:
            sender.side.clear()
        return failure(receiver), receiver

    error, receiver = await asyncio.to_thread(run)
    assert error.code is grpc.StatusCode.CANCELLED, error.failure_reason
    assert "abort" in error.failure_reason.lower(), error.failure_reason
    receiver.side.clear()
    # the frame opened no room on prefill that nothing would ever clear
    assert request.room not in pair.prefill.request_status and request.room not in pair.prefill._rooms
