"""A prefill and a decode SGLang rank on two real brokers, driven as SGLang's schedulers drive them.

Both ranks hold a real MiniMaxSparseKVPool (CPU, /dev/shm) described by SGLang's own
setup_state_kv_args; discovery runs through SGLang's bootstrap server; the request is 10 pages,
decode already holds a 2-page prefix, and prefill sends the other 8 in 3 chunks (the last with the
index-K suffix, the dense KV of all 10 pages and the aux row), through the offered flow: decode's
grant offered to the prefill broker, each chunk one Transfer part. Then every byte of every
component and of the aux row is checked on decode, with the bytes around them, and the KVPolls each
side showed. The failure cases (either side aborting mid-request, either broker restarting) end both
sides Failed with the broker's code and reason, and decode's pages are released only once its
broker says no write into them runs (SGLang's deferred release, acked by the cancel's answer).
Every case runs on both transfer engines.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from kvbroker_client import BrokerClient, Component
from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender
from kvbroker_tools.launch import start_broker
from tests.support import sglang_ranks as ranks
from tests.support.sglang_pair import (
    CHUNKS,
    DECODE_AUX,
    PAGES,
    POLL_TIMEOUT_S,
    PREFILL_AUX,
    PREFIX_PAGES,
    THROUGH,
    Watched,
    assert_decode_bytes,
    decode_saw,
    expected_decode,
    failure,
    fill_prefill_aux,
    first_chunk_lands,
    make_pair,
    new_request,
    polls,
    released,
    send_chunk,
    snapshot,
    start,
)
from tests.support.sglang_ranks import broker_flags

pytestmark = pytest.mark.integration


async def test_a_chunked_request_lands_every_byte_and_the_aux_row(sglang_ranks, engine_brokers):
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(1)
    before = snapshot(pair)
    assert pair.decode.grant_expiry_s == pair.decode.waiting_timeout  # SGLang's own wait for a transfer

    def run():
        sender, receiver = start(pair, request)
        assert sender.side.pop_decode_prefix_len() == PREFIX_PAGES * ranks.PAGE_SIZE
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        first_chunk_lands(sender, receiver)
        for i in range(1, len(CHUNKS)):
            send_chunk(pair, sender, request, i)
        return sender.until(*polls("Success", "Failed")), receiver.until(*polls("Success", "Failed")), \
            sender, receiver

    sent, received, sender, receiver = await asyncio.to_thread(run)
    assert (sent, received) == tuple(polls("Success", "Success")), (sender.seen, receiver.seen)
    assert sender.seen == polls(*THROUGH, "Success") and decode_saw(receiver, "Success"), receiver.seen
    assert_decode_bytes(pair, expected_decode(pair, request, before, len(CHUNKS)))
    got = pair.decode_rank.metadata.get_buf(DECODE_AUX)
    for mine, theirs in zip(got, pair.prefill_rank.metadata.get_buf(PREFILL_AUX)):
        if theirs is not None:
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert int(pair.decode_rank.metadata.bootstrap_room[DECODE_AUX, 0]) == request.room  # decode's room check
    for broker, manager in ((decode_broker, pair.decode), (prefill_broker, pair.prefill)):
        async with await BrokerClient.connect(broker.listen) as client:  # the broker's own record of it
            final = await client.wait(manager.engine_id, str(request.room), timeout=10)
        assert final.parts == len(CHUNKS)  # each send() one part
        # main KV 8 pages in the 3 parts; with the last, the index-K suffix (8) and the dense KV (10)
        assert final.pages == (PAGES - PREFIX_PAGES) * 2 + PAGES and final.truncated_pages == 0
        assert set(final.components) == {Component.MAIN_KV, Component.MINIMAX_INDEX_K, Component.MINIMAX_DENSE_KV}
    sender.side.clear(), receiver.side.clear()
    assert request.room not in pair.prefill._rooms and request.room not in pair.decode._rooms


async def test_a_zero_page_last_chunk_still_lands_the_states_and_the_aux(sglang_ranks, engine_brokers):
    """SGLang's sender lifecycle test (zero-KV final chunk, `init(0)`): decode's prefix holds every page
    of the main KV and the index K, so its grant is the dense KV alone, and prefill's one send() has no
    pages but still carries the dense KV and the aux row."""
    from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages

    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(7)
    before = snapshot(pair)
    prefix = PAGES * ranks.PAGE_SIZE

    def run():
        sender = Watched(KvbrokerKVSender(pair.prefill, pair.bootstrap, request.room))
        receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, request.room))
        receiver.side.init(0)
        receiver.until(*polls("WaitingForInput"))
        index = minimax_index_transfer_pages(request.token_indices(request.decode_pages), page_size=ranks.PAGE_SIZE,
                                             prefix_len=prefix)
        assert len(index) == 0
        receiver.side.send_metadata(np.array([], dtype=np.int32), DECODE_AUX,
                                    [index, request.decode_pages.astype(np.int32)], decode_prefix_len=prefix)
        sender.until(*polls("WaitingForInput"))
        sender.side.init(0, PREFILL_AUX)
        fill_prefill_aux(pair, request.room)
        assert sender.side.should_send_kv_chunk(0, last_chunk=True)
        sender.side.send(np.array([], dtype=np.int32), [index, request.prefill_pages.astype(np.int32)])
        return sender.until(*polls("Success", "Failed")), receiver.until(*polls("Success", "Failed")), receiver

    sent, received, receiver = await asyncio.to_thread(run)
    assert (sent, received) == tuple(polls("Success", "Success"))
    expected = {name: [b.copy() for b in buffers] for name, buffers in before.items()}
    rows = ranks.page_bytes(pair.prefill_rank.pool, "MINIMAX_DENSE_KV", request.prefill_pages)
    for buffer, src in zip(expected["MINIMAX_DENSE_KV"], rows):
        buffer.reshape(-1, src.shape[1])[request.decode_pages] = src
    assert_decode_bytes(pair, expected)  # the main KV and the index K untouched: decode's prefix holds them
    assert int(pair.decode_rank.metadata.bootstrap_room[DECODE_AUX, 0]) == request.room
    async with await BrokerClient.connect(decode_broker.listen) as client:
        final = await client.wait(pair.decode.engine_id, str(request.room), timeout=10)
    assert (final.parts, final.pages, final.components) == (1, PAGES, (Component.MINIMAX_DENSE_KV,))


async def test_a_prefill_abort_mid_request_fails_both_sides_with_the_brokers_reason(sglang_ranks, engine_brokers):
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(2)
    before = snapshot(pair)

    def run():
        sender, receiver = start(pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        first_chunk_lands(sender, receiver)
        sender.side.abort()
        send_chunk(pair, sender, request, 1)  # the scheduler may still call it: nothing moves
        return sender.until(*polls("Failed")), receiver.until(*polls("Failed")), sender, receiver

    _, _, sender, receiver = await asyncio.to_thread(run)
    assert sender.seen == polls(*THROUGH, "Failed") and decode_saw(receiver, "Failed"), receiver.seen
    mine = failure(sender)
    assert mine.code is grpc.StatusCode.CANCELLED and "Aborted by AbortReq" in mine.failure_reason
    error = failure(receiver)
    assert error.code is grpc.StatusCode.CANCELLED and error.failure_reason.startswith("kvbroker CANCELLED: ")
    assert "Aborted by AbortReq" in error.failure_reason
    await asyncio.to_thread(released, pair, receiver)
    assert_decode_bytes(pair, expected_decode(pair, request, before, 1))


async def test_a_decode_abort_mid_request_fails_both_sides_and_nothing_lands_after(sglang_ranks, engine_brokers):
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(3)
    before = snapshot(pair)

    def run():
        sender, receiver = start(pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        first_chunk_lands(sender, receiver)
        receiver.side.abort()
        receiver.until(*polls("Failed"))  # only once the broker's cancel answered: no write runs
        send_chunk(pair, sender, request, 1)
        send_chunk(pair, sender, request, 2)
        return sender.until(*polls("Failed")), sender, receiver

    _, sender, receiver = await asyncio.to_thread(run)
    assert sender.seen == polls(*THROUGH, "Failed") and decode_saw(receiver, "Failed"), receiver.seen
    mine = failure(receiver)
    assert mine.code is grpc.StatusCode.CANCELLED and "Aborted by AbortReq" in mine.failure_reason
    error = failure(sender)
    assert error.code is grpc.StatusCode.CANCELLED and error.failure_reason.startswith("kvbroker CANCELLED: ")
    await asyncio.to_thread(released, pair, receiver)
    assert_decode_bytes(pair, expected_decode(pair, request, before, 1))


async def test_a_receiver_cleared_mid_request_cancels_its_grant_before_its_pages_go(sglang_ranks, engine_brokers):
    """SGLang clears receivers only once they ended; one cleared earlier must not leave its grant
    writable on the broker (until its expiry) while SGLang reuses the pages."""
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(6)
    before = snapshot(pair)

    def run():
        sender, receiver = start(pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        first_chunk_lands(sender, receiver)
        granted = pair.decode.request_of(request.room)
        receiver.side.clear()
        assert granted.cancelled
        granted.wait_quiesced(POLL_TIMEOUT_S)  # the broker answered: no write into the grant runs
        send_chunk(pair, sender, request, 1)
        send_chunk(pair, sender, request, 2)
        return sender.until(*polls("Failed")), sender

    _, sender = await asyncio.to_thread(run)
    error = failure(sender)
    assert error.code is grpc.StatusCode.CANCELLED and "SGLang cleared the request" in error.failure_reason
    assert_decode_bytes(pair, expected_decode(pair, request, before, 1))


async def test_a_decode_broker_restart_mid_request_fails_both_sides_with_the_brokers_reason(sglang_ranks, backend):
    flags = broker_flags(backend)
    prefill_broker = await start_broker(f"sglang-restart-prefill-{backend}", *flags)
    decode_broker = await start_broker(f"sglang-restart-decode-{backend}", *flags)
    try:
        pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
        request = new_request(4)
        before = snapshot(pair)
        sender, receiver = await asyncio.to_thread(start, pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        await asyncio.to_thread(send_chunk, pair, sender, request, 0)
        await asyncio.to_thread(first_chunk_lands, sender, receiver)
        await decode_broker.stop()
        decode_broker = await start_broker(f"sglang-restart-decode-{backend}", *flags, "--listen", decode_broker.listen,
                                           "--peer-listen", decode_broker.peer_listen)
        assert await asyncio.to_thread(receiver.until, *polls("Failed")) == polls("Failed")[0]
        error = failure(receiver)
        assert error.code is grpc.StatusCode.UNAVAILABLE and error.failure_reason.startswith("kvbroker UNAVAILABLE: ")
        await asyncio.to_thread(released, pair, receiver)
        await asyncio.to_thread(send_chunk, pair, sender, request, 1)
        await asyncio.to_thread(send_chunk, pair, sender, request, 2)
        assert await asyncio.to_thread(sender.until, *polls("Failed")) == polls("Failed")[0]
        assert sender.seen == polls(*THROUGH, "Failed") and decode_saw(receiver, "Failed"), receiver.seen
        mine = failure(sender)
        assert mine.code is not None and mine.failure_reason.startswith(f"kvbroker {mine.code.name}: ")
        assert_decode_bytes(pair, expected_decode(pair, request, before, 1))
    finally:
        await asyncio.gather(prefill_broker.stop(), decode_broker.stop())


async def test_a_prefill_broker_restart_mid_request_fails_both_sides_with_the_brokers_reason(sglang_ranks, backend):
    """The prefill broker dies (SIGKILL) and comes back: the offer went with it, prefill's watch is cut,
    and decode's grant fails at its expiry (here 3 s; by default as long as SGLang waits for a transfer,
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT). A graceful stop would drain instead: the offer runs out
    on the old broker, and both sides see its DEADLINE_EXCEEDED."""
    flags = broker_flags(backend)
    prefill_broker = await start_broker(f"sglang-restart2-prefill-{backend}", *flags)
    decode_broker = await start_broker(f"sglang-restart2-decode-{backend}", *flags)
    try:
        pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen, KVBROKER_GRANT_EXPIRY_S="3")
        request = new_request(5)
        before = snapshot(pair)
        sender, receiver = await asyncio.to_thread(start, pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        await asyncio.to_thread(send_chunk, pair, sender, request, 0)
        await asyncio.to_thread(first_chunk_lands, sender, receiver)
        prefill_broker.kill()
        await prefill_broker.stop()
        prefill_broker = await start_broker(f"sglang-restart2-prefill-{backend}", *flags, "--listen",
                                            prefill_broker.listen, "--peer-listen", prefill_broker.peer_listen)
        assert await asyncio.to_thread(sender.until, *polls("Failed")) == polls("Failed")[0]
        mine = failure(sender)
        assert mine.code is grpc.StatusCode.UNAVAILABLE and mine.failure_reason.startswith("kvbroker UNAVAILABLE: ")
        await asyncio.to_thread(send_chunk, pair, sender, request, 1)
        assert await asyncio.to_thread(receiver.until, *polls("Failed")) == polls("Failed")[0]
        assert sender.seen == polls(*THROUGH, "Failed") and decode_saw(receiver, "Failed"), receiver.seen
        error = failure(receiver)
        assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.failure_reason.startswith("kvbroker DEADLINE_EXCEEDED: ")
        await asyncio.to_thread(released, pair, receiver)
        assert_decode_bytes(pair, expected_decode(pair, request, before, 1))
    finally:
        await asyncio.gather(prefill_broker.stop(), decode_broker.stop())
