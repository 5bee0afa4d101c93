"""BrokerClient on the Exchange stream against real brokers: the offered flow on one stream per
client, a broken stream opened again with the wait reporting how the broker ended its request, a
watch its caller leaves or lets reach its deadline leaving no command on the broker, and the unary
calls where the stream is not offered."""

from __future__ import annotations

import numpy as np
import pytest

from kvbroker.edge.exchange import END_REASON
from kvbroker_client import Cancelled, Component, DeadlineExceeded, TransferState
from tests.support.pool_engines import pool_engine
from tests.support.pools import assert_pool_equals, connect, expected_destination, fragmented, unique

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

MAIN = Component.MAIN_KV


async def engines_on(prefill_client, decode_client, pools):
    src = pool_engine(pools, unique("prefill"), fill="random", sparse_layers=())
    dst = pool_engine(pools, unique("decode"), fill="canary", sparse_layers=())
    await prefill_client.register_engine(src.engine_id, src.topology, src.components)
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    return src, dst


async def test_an_offered_request_goes_on_one_stream_per_client(prefill_client, decode_client, pools):
    src, dst = await engines_on(prefill_client, decode_client, pools)
    rng = np.random.default_rng(31)
    src_ids, dst_ids = fragmented(rng, 32, 12), fragmented(rng, 32, 12)
    before = dst.pool.bytes.copy()
    rid = unique("req")
    sender = (await prefill_client.info()).peer_address
    granted = await decode_client.expect_transfer(dst.engine_id, rid, {MAIN: dst_ids}, sender_address=sender,
                                                  sender_engine_id=src.engine_id)
    assert granted.state is TransferState.PENDING
    first = await prefill_client.transfer_part(src.engine_id, rid, {MAIN: src_ids[:5]}, last=False)
    assert first.state is TransferState.TRANSFERRING
    last = await prefill_client.transfer_part(src.engine_id, rid, {MAIN: src_ids[5:]}, dst_offsets={MAIN: 5},
                                              aux=b"token", last=True)
    received = await decode_client.wait(dst.engine_id, rid, timeout=30)
    assert last.state is received.state is TransferState.SUCCEEDED and received.aux == b"token"
    assert_pool_equals(dst.pool, expected_destination(src.pool, dst.pool, before, src.components, dst.components,
                                                      src_ids, dst_ids))
    assert prefill_client.exchange.streams_opened == decode_client.exchange.streams_opened == 1


async def test_a_broken_stream_is_opened_again_and_the_wait_reports_the_request_it_carried(
        prefill_client, decode_client, pools):
    src, dst = await engines_on(prefill_client, decode_client, pools)
    rid = unique("req")
    sender = (await prefill_client.info()).peer_address
    await decode_client.expect_transfer(dst.engine_id, rid, {MAIN: [1, 2]}, sender_address=sender,
                                        sender_engine_id=src.engine_id)
    watch = decode_client.watch(dst.engine_id, rid, timeout=30)
    assert (await anext(watch)).state is TransferState.PENDING
    await decode_client.exchange.close()  # the stream breaks under the watch and the grant it carried
    final = [status async for status in watch][-1]
    assert (final.state, final.code) == (TransferState.FAILED, Cancelled.code) and END_REASON in final.reason
    assert decode_client.exchange.streams_opened == 2  # the watch was made again on a new stream
    again = unique("req")
    granted = await decode_client.expect_transfer(dst.engine_id, again, {MAIN: [1, 2]}, sender_address=sender,
                                                  sender_engine_id=src.engine_id)
    assert granted.state is TransferState.PENDING and decode_client.exchange.streams_opened == 2
    await prefill_client.transfer_part(src.engine_id, again, {MAIN: [3, 4]}, last=True)
    assert (await decode_client.wait(dst.engine_id, again, timeout=30)).state is TransferState.SUCCEEDED


async def test_a_watch_left_by_its_caller_or_its_deadline_leaves_no_command_on_the_broker(brokers_of_test, pools):
    """On a broker that runs two commands per stream: six watches of a grant that stays PENDING, each
    left after its first status or at its deadline, one after another on one stream. Each frees its
    slot: the stream takes the next, and the client cancelled each (no slot is waited out)."""
    broker = await brokers_of_test.start("--max-exchange-commands", "2")
    client = await connect(broker.listen)
    try:
        dst = pool_engine(pools, unique("decode"), fill="canary", sparse_layers=())
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        rid = unique("req")
        await client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2], expiry_s=600)
        for _ in range(3):
            watching = client.watch(dst.engine_id, rid, timeout=60)
            assert (await anext(watching)).state is TransferState.PENDING
            await watching.aclose()  # the caller stops iterating
            with pytest.raises(DeadlineExceeded):
                await client.wait(dst.engine_id, rid, timeout=0.2)
        assert await client.exchange.cancels_answered(30)
        assert client.exchange.cancels_sent == 6 and client.exchange.streams_opened == 1
        both = [client.watch(dst.engine_id, rid, timeout=60) for _ in range(2)]  # both slots are free
        assert [(await anext(w)).state for w in both] == [TransferState.PENDING] * 2
        for watching in both:
            await watching.aclose()
    finally:
        await client.close()


@pytest.mark.parametrize("without", ["exchange=False", "no stream offered"])
async def test_a_client_without_the_stream_uses_the_unary_calls(client_brokers, decode_client, pools, without):
    prefill = await connect(client_brokers.prefill.listen, exchange=without != "exchange=False")
    try:
        if prefill.exchange is not None:
            prefill.exchange.supported = False  # what an UNIMPLEMENTED answer leaves (tests/integration)
        src, dst = await engines_on(prefill, decode_client, pools)
        rid = unique("req")
        sender = (await prefill.info()).peer_address
        await decode_client.expect_transfer(dst.engine_id, rid, {MAIN: [5, 6]}, sender_address=sender,
                                            sender_engine_id=src.engine_id)
        done = await prefill.transfer_part(src.engine_id, rid, {MAIN: [7, 8]}, last=True)
        assert done.state is TransferState.SUCCEEDED
        assert (await prefill.wait(src.engine_id, rid, timeout=30)).state is TransferState.SUCCEEDED
        assert prefill.exchange is None or prefill.exchange.streams_opened == 0
    finally:
        await prefill.unregister_engine(src.engine_id)
        await prefill.close()
