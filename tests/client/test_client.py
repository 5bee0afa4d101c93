"""BrokerClient against real brokers: the calls, their deadlines, typed errors and broker restarts."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest

from kvbroker_client import (
    Aborted,
    AlreadyExists,
    BrokerError,
    Cancelled,
    Component,
    ComponentSpec,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Layout,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TransferRole,
    TransferState,
    Unavailable,
    Unimplemented,
)
from tests.support.pool_engines import pool_engine
from tests.support.pools import assert_pool_equals, connect, expected_destination, fragmented, unique

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

BOTH = (Component.MAIN_KV, Component.MINIMAX_INDEX_K)


async def engines_on(prefill_client, decode_client, pools, **decode_topology):
    src = pool_engine(pools, unique("prefill"), fill="random")
    dst = pool_engine(pools, unique("decode"), fill="canary", **decode_topology)
    await prefill_client.register_engine(src.engine_id, src.topology, src.components)
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    return src, dst


def assert_raised(info: pytest.ExceptionInfo, cls: type[BrokerError], code: grpc.StatusCode, *words: str) -> None:
    error = info.value
    assert type(error) is cls
    assert error.code is code
    for word in words:
        assert word in error.reason


# -- connecting ------------------------------------------------------------------------------------
async def test_connect_over_tcp_reports_the_broker(client_brokers):
    async with await connect(client_brokers.prefill.listen) as client:
        info = await client.info()
    assert info.broker_id == "client-prefill"
    assert info.epoch == client.epoch != 0
    assert info.backend == "nixl"
    assert info.peer_address == client_brokers.prefill.peer_listen


async def test_connect_over_unix_socket(brokers_of_test, tmp_path):
    socket = f"unix:{tmp_path}/kvbroker.sock"
    broker = await brokers_of_test.start("--listen", socket)
    assert broker.listen == socket
    async with await connect(socket) as client:
        assert (await client.info()).broker_id == broker.broker_id


async def test_connect_to_no_broker_raises_unavailable_after_its_timeout():
    with pytest.raises(Unavailable) as info:
        await connect("127.0.0.1:1", timeout=0.5)
    assert_raised(info, Unavailable, grpc.StatusCode.UNAVAILABLE, "127.0.0.1:1")


# -- engines and requests --------------------------------------------------------------------------
async def test_registered_engine_is_listed_until_unregistered(prefill_client, pools):
    engine = pool_engine(pools, unique("prefill"), fill="random")
    info = await prefill_client.register_engine(engine.engine_id, engine.topology, engine.components)
    assert info.engine_id == engine.engine_id
    assert info.topology == engine.topology
    assert info.components == tuple(engine.components)
    assert info.registered_bytes == sum(b.length for c in engine.components for b in c.layer_buffers)
    assert engine.engine_id in (await prefill_client.info()).engine_ids
    assert await prefill_client.unregister_engine(engine.engine_id) == 0
    assert engine.engine_id not in (await prefill_client.info()).engine_ids


async def test_transfer_moves_every_page_and_leaves_the_canaries(prefill_client, decode_client, client_brokers,
                                                                 pools):
    src, dst = await engines_on(prefill_client, decode_client, pools)
    rng = np.random.default_rng(7)
    src_ids, dst_ids = fragmented(rng, 32, 20), fragmented(rng, 32, 20)
    before = dst.pool.bytes.copy()
    rid = unique("req")
    grant = await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=dst_ids, components=BOTH, expiry_s=30)
    assert (grant.state, grant.role) == (TransferState.PENDING, TransferRole.RECEIVER)
    peer = (await decode_client.info()).peer_address
    sent = await prefill_client.transfer(src.engine_id, rid, peer, dst.engine_id, src_ids, components=BOTH)
    received = await decode_client.wait(dst.engine_id, rid, timeout=30)
    assert sent.state is received.state is TransferState.SUCCEEDED
    assert sent.pages == received.pages == 20
    assert sent.bytes == 20 * (2 * 3 * 64 + 2 * 16)
    assert set(received.components) == set(BOTH)
    assert_pool_equals(dst.pool, expected_destination(src.pool, dst.pool, before, src.components, dst.components,
                                                      src_ids, dst_ids))


async def test_watch_streams_each_state_of_the_grant(prefill_client, decode_client, pools):
    src, dst = await engines_on(prefill_client, decode_client, pools)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[3, 4, 5])
    watch = decode_client.watch(dst.engine_id, rid, timeout=30)
    first = await anext(watch)
    assert first.state is TransferState.PENDING
    peer = (await decode_client.info()).peer_address
    await prefill_client.transfer(src.engine_id, rid, peer, dst.engine_id, [0, 1, 2])
    rest = [status.state async for status in watch]
    assert rest == [TransferState.TRANSFERRING, TransferState.SUCCEEDED]


async def test_cancelled_grant_makes_wait_raise_cancelled_with_the_reason(decode_client, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2])
    after = await decode_client.cancel(dst.engine_id, rid, "decode ran out of memory")
    assert after.state is TransferState.FAILED
    assert after.code is grpc.StatusCode.CANCELLED
    with pytest.raises(Cancelled) as info:
        await decode_client.wait(dst.engine_id, rid, timeout=10)
    assert_raised(info, Cancelled, grpc.StatusCode.CANCELLED, "decode ran out of memory")
    assert info.value.status.state is TransferState.FAILED


# -- deadlines -------------------------------------------------------------------------------------
async def test_wait_past_its_deadline_raises_deadline_exceeded(decode_client, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2], expiry_s=60)
    with pytest.raises(DeadlineExceeded) as info:
        await decode_client.wait(dst.engine_id, rid, timeout=0.3)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    still = await anext(decode_client.watch(dst.engine_id, rid, timeout=5))
    assert still.state is TransferState.PENDING  # the caller's deadline ends the wait, not the grant
    await decode_client.cancel(dst.engine_id, rid)


async def test_default_deadline_bounds_a_call_that_passes_none(client_brokers, pools):
    async with await connect(client_brokers.decode.listen, transfer_timeout=0.3) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        rid = unique("req")
        await client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1], expiry_s=60)
        with pytest.raises(DeadlineExceeded):
            await client.wait(dst.engine_id, rid)
        await client.unregister_engine(dst.engine_id)


async def test_expired_grant_fails_the_request_with_deadline_exceeded(decode_client, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2], expiry_s=0.2)
    with pytest.raises(DeadlineExceeded) as info:
        await decode_client.wait(dst.engine_id, rid, timeout=10)
    assert info.value.status.state is TransferState.FAILED
    assert info.value.status.code is grpc.StatusCode.DEADLINE_EXCEEDED


# -- every refusal as its typed error --------------------------------------------------------------
async def test_unknown_engine_raises_not_found(prefill_client):
    with pytest.raises(NotFound) as info:
        await prefill_client.unregister_engine("no-such-engine")
    assert_raised(info, NotFound, grpc.StatusCode.NOT_FOUND, "no-such-engine")


async def test_unknown_request_raises_not_found(decode_client, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    with pytest.raises(NotFound) as info:
        await decode_client.wait(dst.engine_id, "no-such-request", timeout=5)
    assert_raised(info, NotFound, grpc.StatusCode.NOT_FOUND, "no-such-request")


async def test_malformed_engine_id_raises_invalid_argument(prefill_client, pools):
    engine = pool_engine(pools, "unused", fill="random")
    with pytest.raises(InvalidArgument) as info:
        await prefill_client.register_engine("not an id!", engine.topology, engine.components)
    assert_raised(info, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "engine_id")
    assert prefill_client.registered_engines == ()


async def test_negative_page_id_raises_invalid_argument_before_any_call(decode_client):
    with pytest.raises(InvalidArgument) as info:
        await decode_client.expect_transfer("any", "req", dst_page_ids=[1, -2])
    assert_raised(info, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "dst_page_ids[1]")


async def test_engine_registered_twice_raises_already_exists(prefill_client, pools):
    engine = pool_engine(pools, unique("prefill"), fill="random")
    await prefill_client.register_engine(engine.engine_id, engine.topology, engine.components)
    other = pool_engine(pools, "unused", fill="random")
    with pytest.raises(AlreadyExists) as info:
        await prefill_client.register_engine(engine.engine_id, other.topology, other.components)
    assert_raised(info, AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, engine.engine_id)


async def test_request_granted_twice_raises_already_exists(decode_client, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1])
    with pytest.raises(AlreadyExists) as info:
        await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[2])
    assert_raised(info, AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, rid)


async def test_mismatched_page_size_raises_failed_precondition(prefill_client, decode_client, pools):
    src, dst = await engines_on(prefill_client, decode_client, pools, page_size=8)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2])
    peer = (await decode_client.info()).peer_address
    with pytest.raises(FailedPrecondition) as info:
        await prefill_client.transfer(src.engine_id, rid, peer, dst.engine_id, [1, 2])
    assert_raised(info, FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "page_size")


async def test_index_k_with_pipeline_parallel_raises_failed_precondition(prefill_client, decode_client, pools):
    src, dst = await engines_on(prefill_client, decode_client, pools, pp_size=2)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2], components=BOTH)
    peer = (await decode_client.info()).peer_address
    with pytest.raises(FailedPrecondition) as info:
        await prefill_client.transfer(src.engine_id, rid, peer, dst.engine_id, [1, 2], components=BOTH)
    assert_raised(info, FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "PP>1")


async def test_pages_outside_the_grant_raise_permission_denied(prefill_client, decode_client, pools):
    src, dst = await engines_on(prefill_client, decode_client, pools)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2])
    peer = (await decode_client.info()).peer_address
    with pytest.raises(PermissionDenied) as info:
        await prefill_client.transfer(src.engine_id, rid, peer, dst.engine_id, [1, 2], dst_page_ids=[1, 9])
    assert_raised(info, PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, "outside the grant")


async def test_index_with_value_raises_unimplemented(prefill_client, pools):
    engine = pool_engine(pools, unique("prefill"), fill="random")
    main, index = engine.components
    with_value = ComponentSpec(Component.MINIMAX_INDEX_KV, Layout.FLAT, index.num_pages, index.layer_buffers)
    with pytest.raises(Unimplemented) as info:
        await prefill_client.register_engine(engine.engine_id, engine.topology, [main, with_value])
    assert_raised(info, Unimplemented, grpc.StatusCode.UNIMPLEMENTED, "MINIMAX_INDEX_KV")


async def test_unreachable_peer_raises_unavailable(prefill_client, pools):
    src = pool_engine(pools, unique("prefill"), fill="random")
    await prefill_client.register_engine(src.engine_id, src.topology, src.components)
    epoch = prefill_client.epoch
    with pytest.raises(Unavailable) as info:
        await prefill_client.transfer(src.engine_id, unique("req"), "127.0.0.1:1", "decode-x", [1], timeout=10)
    assert_raised(info, Unavailable, grpc.StatusCode.UNAVAILABLE, "127.0.0.1:1")
    assert (prefill_client.epoch, prefill_client.restarts_seen) == (epoch, 0)  # the broker itself is fine


async def test_too_many_pages_raise_resource_exhausted(brokers_of_test, pools):
    broker = await brokers_of_test.start("--max-pages-per-request", "4")
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary", num_pages=4)
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        with pytest.raises(ResourceExhausted) as info:
            await client.expect_transfer(dst.engine_id, unique("req"), dst_page_ids=[0, 1, 2, 3, 4])
    assert_raised(info, ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, "limit of 4")


async def test_unregistering_an_engine_aborts_its_grants(decode_client, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
    rid = unique("req")
    await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2])
    waiting = asyncio.create_task(decode_client.wait(dst.engine_id, rid, timeout=30))
    assert await decode_client.unregister_engine(dst.engine_id) == 1
    with pytest.raises(Aborted) as info:
        await waiting
    assert_raised(info, Aborted, grpc.StatusCode.ABORTED, "unregistered")


# -- sessions ----------------------------------------------------------------------------------------
async def test_engines_are_held_by_the_clients_session(client_brokers, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    async with await connect(client_brokers.decode.listen, holder="decode-0 test") as client:
        engine = await client.register_engine(dst.engine_id, dst.topology, dst.components)
        info = await client.info()
        assert engine.session_id == client.session_id != ""
    assert client.session_id == ""  # closed with the client
    [session] = [x for x in info.sessions if x.session_id == engine.session_id]
    assert (session.holder, session.engine_ids) == ("decode-0 test", (dst.engine_id,))


async def test_closing_the_client_releases_its_engines_and_fails_their_grants(client_brokers, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    async with await connect(client_brokers.decode.listen, session=False) as bystander:
        client = await connect(client_brokers.decode.listen)
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        rid = unique("req")
        await bystander.expect_transfer(dst.engine_id, rid, dst_page_ids=[1, 2])  # a grant on the held engine
        waiting = asyncio.create_task(bystander.wait(dst.engine_id, rid, timeout=30))
        await client.close()
        with pytest.raises(Aborted) as info:
            await waiting
        assert dst.engine_id not in (await bystander.info()).engine_ids
    assert_raised(info, Aborted, grpc.StatusCode.ABORTED, f"engine {dst.engine_id!r} was unregistered")


async def test_without_a_session_engines_outlive_the_client(client_brokers, pools):
    dst = pool_engine(pools, unique("decode"), fill="canary")
    async with await connect(client_brokers.decode.listen, session=False) as client:
        engine = await client.register_engine(dst.engine_id, dst.topology, dst.components)
    assert engine.session_id == "" and client.session_id == ""
    async with await connect(client_brokers.decode.listen, session=False) as other:
        assert dst.engine_id in (await other.info()).engine_ids
        assert await other.unregister_engine(dst.engine_id) == 0


async def test_broker_owned_memory_is_asked_for_by_the_client(client_brokers, pools):
    """The CPU broker has no CUDA: its refusal names the broker's pool, so the ownership reached it."""
    src = pool_engine(pools, unique("prefill"), fill="random")
    bare = [ComponentSpec(c.component, c.layout, c.num_pages,
                          tuple(dataclasses.replace(b, memory=None) for b in c.layer_buffers))
            for c in src.components]
    async with await connect(client_brokers.prefill.listen) as client:
        with pytest.raises(InvalidArgument) as info:
            await client.register_engine(src.engine_id, src.topology, bare, memory_ownership="broker")
        with pytest.raises(InvalidArgument) as unknown:
            await client.register_engine(src.engine_id, src.topology, src.components, memory_ownership="both")
    assert_raised(info, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT,
                  "memory_ownership: MEMORY_OWNERSHIP_BROKER", "no CUDA support")
    assert "memory_ownership: 'both' is not one of ['broker', 'server']" in unknown.value.reason


async def test_a_session_lost_without_a_restart_is_opened_again_with_the_engines(client_brokers, pools):
    """A session stream that breaks while the broker lives (the connection dropped; here the client's
    call is cancelled under it) loses the engines; the next call that misses one registers them again."""
    dst = pool_engine(pools, unique("decode"), fill="canary")
    async with await connect(client_brokers.decode.listen) as client:
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        lost = client.session_id
        rid = unique("req")
        await client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1])
        waiting = asyncio.create_task(client.wait(dst.engine_id, rid, timeout=30))
        client._session.call.cancel()
        with pytest.raises(Aborted):
            await waiting  # the broker released the engine: its grant failed
        status = await client.expect_transfer(dst.engine_id, unique("req"), dst_page_ids=[2], timeout=30)
        info = await client.info()
        assert status.state is TransferState.PENDING
        assert client.session_id not in ("", lost)
        assert [x.engine_ids for x in info.sessions if x.session_id == client.session_id] == [(dst.engine_id,)]
    assert client.restarts_seen == 0


# -- broker restarts -------------------------------------------------------------------------------
async def registered_on(broker, engine_id: str, timeout: float = 30.0) -> None:
    """Until a client of its own sees `engine_id` registered on `broker` (the rejoin, not a call, put it there)."""
    async with await connect(broker.listen, session=False) as observer:
        async def registered() -> None:
            for _ in range(1000):  # bounded by wait_for below
                if engine_id in (await observer.info()).engine_ids:
                    return
                await asyncio.sleep(0.05)

        await asyncio.wait_for(registered(), timeout)


async def test_client_registers_its_engines_again_after_a_restart_on_the_same_port(brokers_of_test, pools):
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        old_epoch, old_session = client.epoch, client.session_id
        broker = await brokers_of_test.restart(broker)
        status = await client.expect_transfer(dst.engine_id, unique("req"), dst_page_ids=[1, 2], timeout=30)
        assert status.state is TransferState.PENDING
        info = await client.info()
        new_session = client.session_id
    assert client.restarts_seen == 1
    assert info.epoch == client.epoch != old_epoch
    assert info.engine_ids == (dst.engine_id,)
    # a new session holds the engine: the old one went with the old broker
    assert info.engines[0].session_id == new_session not in ("", old_session)
    assert [x.engine_ids for x in info.sessions] == [(dst.engine_id,)]


async def test_engines_are_registered_again_after_a_restart_before_the_client_calls(brokers_of_test, pools):
    """A peer's offer can reach a restarted broker before this process calls it again (a prefill
    server idle between requests): the client registers its engines as soon as the broker is back."""
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        broker = await brokers_of_test.restart(broker)
        await registered_on(broker, dst.engine_id)
        assert client.restarts_seen == 1


async def test_a_broker_restarted_under_another_id_is_told_by_the_new_one(brokers_of_test, pools):
    """An adapter tells the other side its broker's id (the receiver its parts name) and peer address
    from the client: after a restart under another id, they are the new broker's, with no call."""
    broker = await brokers_of_test.start(name="told-before")
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        assert client.broker_id == "told-before" and client.peer_address
        broker = await brokers_of_test.restart(broker, "--broker-id", "told-after")
        await registered_on(broker, dst.engine_id)
        async with await connect(broker.listen, session=False) as observer:
            now = await observer.info()
        assert (client.broker_id, client.peer_address) == ("told-after", now.peer_address)


async def test_a_restart_whose_first_registration_fails_is_counted_once(brokers_of_test, pools):
    """The rejoin retries a registration that failed; the retry is the same restart, not a second one."""
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        register, failed = client._stub.RegisterEngine, []

        async def fails_once(request, **kwargs):
            if not failed:
                failed.append(request.engine_id)
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="injected: the first registration after the restart fails")
            return await register(request, **kwargs)

        client._stub.RegisterEngine = fails_once
        broker = await brokers_of_test.restart(broker)
        await registered_on(broker, dst.engine_id)
    assert failed == [dst.engine_id]
    assert client.restarts_seen == 1


async def test_info_notices_a_new_epoch_and_registers_again(brokers_of_test, pools):
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        await brokers_of_test.restart(broker)
        info = await client.info(timeout=30, wait_for_ready=True)
    assert info.engine_ids == (dst.engine_id,)
    assert client.restarts_seen == 1


async def test_concurrent_calls_after_a_restart_register_once(brokers_of_test, pools):
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        await brokers_of_test.restart(broker)
        statuses = await asyncio.gather(*(client.expect_transfer(dst.engine_id, unique("req"), dst_page_ids=[i],
                                                                 timeout=30)
                                          for i in range(8)))
    assert {s.state for s in statuses} == {TransferState.PENDING}
    assert client.restarts_seen == 1


async def test_transfer_works_after_the_decode_broker_restarts(brokers_of_test, prefill_client, pools):
    decode = await brokers_of_test.start()
    async with await connect(decode.listen) as decode_client:
        src = pool_engine(pools, unique("prefill"), fill="random")
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await prefill_client.register_engine(src.engine_id, src.topology, src.components)
        await decode_client.register_engine(dst.engine_id, dst.topology, dst.components)
        first = unique("req")
        await decode_client.expect_transfer(dst.engine_id, first, dst_page_ids=[1], components=BOTH)
        await prefill_client.transfer(src.engine_id, first, decode.peer_listen, dst.engine_id, [1], components=BOTH)

        await brokers_of_test.restart(decode)
        dst.pool.bytes[:] = 0xA5
        before = dst.pool.bytes.copy()
        rid = unique("req")
        src_ids, dst_ids = [5, 6, 7, 20], [30, 2, 3, 4]
        await decode_client.expect_transfer(dst.engine_id, rid, dst_page_ids=dst_ids, components=BOTH, timeout=30)
        await prefill_client.transfer(src.engine_id, rid, decode.peer_listen, dst.engine_id, src_ids,
                                      components=BOTH, timeout=30)
        await decode_client.wait(dst.engine_id, rid, timeout=30)
    assert decode_client.restarts_seen == 1
    assert_pool_equals(dst.pool, expected_destination(src.pool, dst.pool, before, src.components, dst.components,
                                                      src_ids, dst_ids))


async def test_call_while_the_broker_is_down_raises_unavailable_within_its_deadline(brokers_of_test):
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        await brokers_of_test.stop(broker)
        with pytest.raises(Unavailable):
            await client.info(timeout=0.5)


async def test_wait_on_a_stopping_broker_raises_unavailable(brokers_of_test, pools):
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        rid = unique("req")
        await client.expect_transfer(dst.engine_id, rid, dst_page_ids=[1])
        watch = client.watch(dst.engine_id, rid, timeout=30)
        assert (await anext(watch)).state is TransferState.PENDING
        waiting = asyncio.create_task(client.wait(dst.engine_id, rid, timeout=30))
        await brokers_of_test.stop(broker)
        last = [status async for status in watch][-1]
        with pytest.raises(Unavailable) as info:
            await waiting
    assert (last.state, last.code) == (TransferState.FAILED, grpc.StatusCode.UNAVAILABLE)
    assert "shut down" in last.reason
    assert_raised(info, Unavailable, grpc.StatusCode.UNAVAILABLE)  # the stream's end, or the broker's


async def test_unregistering_an_engine_the_restart_released_returns_zero(brokers_of_test, pools):
    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        dst = pool_engine(pools, unique("decode"), fill="canary")
        await client.register_engine(dst.engine_id, dst.topology, dst.components)
        await brokers_of_test.restart(broker)
        assert await client.unregister_engine(dst.engine_id) == 0
        assert (await client.info()).engine_ids == ()
    assert client.restarts_seen == 1


async def test_a_broker_owned_engine_is_not_registered_again_after_a_restart(brokers_of_test, pools):
    """Its pool went with the old broker, so registering the old request again would hand the server
    a new, empty pool behind its back. No broker without CUDA allocates pools: a shared-memory engine
    stands in, marked broker-owned in the client's record, which is all the restart logic reads."""
    from kvbroker_client.v1 import broker_service_pb2 as bpb

    broker = await brokers_of_test.start()
    async with await connect(broker.listen) as client:
        pooled, kept = (pool_engine(pools, unique("decode"), fill="canary") for _ in range(2))
        for engine in (pooled, kept):
            await client.register_engine(engine.engine_id, engine.topology, engine.components)
        client._registrations.engines[pooled.engine_id].memory_ownership = bpb.MEMORY_OWNERSHIP_BROKER
        await brokers_of_test.restart(broker)
        with pytest.raises(NotFound) as info:
            await client.expect_transfer(pooled.engine_id, unique("req"), dst_page_ids=[1], timeout=30)
        assert client.lost_engines == (pooled.engine_id,)
        assert (await client.info()).engine_ids == (kept.engine_id,)
        assert await client.unregister_engine(pooled.engine_id) == 0
        assert client.lost_engines == ()
    assert_raised(info, NotFound, grpc.StatusCode.NOT_FOUND, "broker-owned memory",
                  "register it again and use the new pool")
