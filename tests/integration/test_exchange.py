"""The Exchange stream (BrokerService.Exchange) on two real brokers and real engines: a whole offered
request through it, its commands refused as their unary RPCs are, the requests a stream carried
failed when it ends, and its bound on commands in flight."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvbroker.edge.exchange import END_REASON
from kvbroker_client.errors import BrokerError, ResourceExhausted
from kvbroker_client.exchange import Exchange, ExchangeUnsupported
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import SMALL, assert_bytes, close_broker, open_broker
from tests.support.flows import DENSE, INDEX, M3, MAIN, expect_pages, offer, part, refusal, rest, watch_all
from tests.support.helpers import until

pytestmark = pytest.mark.integration

CANCELLED = grpc.StatusCode.CANCELLED.value[0]


def stream(broker) -> Exchange:
    return Exchange(broker.stub, broker.process.listen)


def offer_request(dst, src, request_id, pages: dict, expiry_ms=30_000) -> bpb.ExpectTransferRequest:
    return bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, expiry_ms=expiry_ms,
        pages=[pb.ComponentPages(component=k, page_ids=list(map(int, v))) for k, v in pages.items()],
        sender_address=src.broker.peer_address, sender_engine_id=src.engine_id)


def part_request(src, request_id, pages: dict, *, offsets=None, last=True, aux=b"") -> bpb.TransferRequest:
    offsets = offsets or {}
    return bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, more_parts=not last, aux=aux,
        pages=[bpb.PartPages(component=k, src_page_ids=list(map(int, v)), dst_offset=offsets.get(k, 0))
               for k, v in pages.items()])


async def statuses(exchange: Exchange, engine, request_id) -> list:
    request = bpb.WatchTransferRequest(engine_id=engine.engine_id, request_id=request_id)
    return [s async for s in exchange.watch(request, 30)]


async def test_a_chunked_request_through_the_stream_lands_every_byte_and_its_aux(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=21)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    decode, prefill = stream(brokers.decode), stream(brokers.prefill)
    try:
        rng = np.random.default_rng(21)
        src_all, dst_all = rng.permutation(SMALL.num_pages)[:10], rng.permutation(SMALL.num_pages)[:10]
        before = dst.segment.array.copy()
        granted = await decode.command("expect", offer_request(dst, src, request_id,
                                                               {MAIN: dst_all, INDEX: dst_all[2:], DENSE: dst_all}), 10)
        assert granted.expect.status.state == pb.TRANSFER_STATE_PENDING
        watching = asyncio.ensure_future(statuses(decode, dst, request_id))
        first = await prefill.command("transfer", part_request(src, request_id, {MAIN: src_all[:6]}, last=False), 30)
        assert first.transfer.status.state == pb.TRANSFER_STATE_TRANSFERRING
        last = await prefill.command("transfer", part_request(
            src, request_id, {MAIN: src_all[6:], INDEX: src_all[2:], DENSE: src_all}, offsets={MAIN: 6},
            aux=b"first token"), 30)
        assert last.transfer.status.state == pb.TRANSFER_STATE_SUCCEEDED and last.transfer.status.parts == 2
        seen = await asyncio.wait_for(watching, 30)
        assert seen[0].state == pb.TRANSFER_STATE_PENDING
        assert seen[-1].state == pb.TRANSFER_STATE_SUCCEEDED and seen[-1].aux == b"first token"
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, src_all, dst_all), (INDEX, src_all[2:], dst_all[2:]),
                                                          (DENSE, src_all, dst_all)]))
        assert decode.streams_opened == prefill.streams_opened == 1  # every command on one stream each
    finally:
        await decode.close()
        await prefill.close()


async def test_one_message_per_step_the_grant_and_its_end_are_one_command_and_the_last_part_ends_the_watch(
        brokers, engines, request_id):
    """Decode's grant and its end are one command (expect_watch: the grant's PENDING, then SUCCEEDED
    with the aux); prefill's last part (end_watches) ends prefill's watch of the request, which the
    broker then sends nothing: the part's reply is the watch's end. Counted on each stream, with a
    ping last so that a message sent before it would have been read: decode reads 3 messages
    (grant, end, pong), prefill 2 (the part's reply, pong) for 2 and 3 commands."""
    src = await engines.make(brokers.prefill, "prefill", seed=26)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    decode, prefill = stream(brokers.decode), stream(brokers.prefill)
    try:
        before = dst.segment.array.copy()
        following = decode.expect_watch(offer_request(dst, src, request_id, {MAIN: [7, 8, 9]}), 30, 10)
        assert (await anext(following)).state == pb.TRANSFER_STATE_PENDING
        sender_watch = prefill.watch(bpb.WatchTransferRequest(engine_id=src.engine_id, request_id=request_id,
                                                              terminal_only=True, offer_wait_ms=10_000), 30)
        watching = asyncio.ensure_future(anext(sender_watch))
        await until(lambda: prefill.commands_sent == 1)  # the watch went first
        last = part_request(src, request_id, {MAIN: [1, 2, 3]}, aux=b"token 9")
        last.end_watches = True
        done = await prefill.command("transfer", last, 30)
        assert done.transfer.status.state == pb.TRANSFER_STATE_SUCCEEDED
        ended = await asyncio.wait_for(watching, 10)
        assert (ended.state, ended.parts, ended.pages) == (pb.TRANSFER_STATE_SUCCEEDED, 1, 3)
        with pytest.raises(StopAsyncIteration):
            await anext(sender_watch)
        received = [s async for s in following]
        assert [(s.state, s.aux) for s in received] == [(pb.TRANSFER_STATE_SUCCEEDED, b"token 9")]
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [1, 2, 3], [7, 8, 9])]))
        await decode.ping(10)
        await prefill.ping(10)
        assert (decode.commands_sent, decode.replies_read) == (2, 3)
        assert (prefill.commands_sent, prefill.replies_read) == (3, 2)
        assert prefill.cancels_sent == decode.cancels_sent == 0  # nothing was left to cancel
    finally:
        await decode.close()
        await prefill.close()


async def test_a_part_that_fails_leaves_the_watch_its_own_end(brokers, engines, request_id):
    """end_watches takes effect on SUCCEEDED only: after a last part refused (a component the
    grant lacks), prefill's watch still ends with the request's own terminal status, here decode's cancel."""
    src = await engines.make(brokers.prefill, "prefill", seed=27)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    decode, prefill = stream(brokers.decode), stream(brokers.prefill)
    try:
        before = dst.segment.array.copy()
        following = decode.expect_watch(offer_request(dst, src, request_id, {MAIN: [7, 8]}), 30, 10)
        assert (await anext(following)).state == pb.TRANSFER_STATE_PENDING
        sender_watch = prefill.watch(bpb.WatchTransferRequest(engine_id=src.engine_id, request_id=request_id,
                                                              terminal_only=True, offer_wait_ms=10_000), 30)
        watching = asyncio.ensure_future(anext(sender_watch))
        await until(lambda: prefill.commands_sent == 1)
        last = part_request(src, request_id, {MAIN: [1, 2], INDEX: [1, 2]})  # INDEX: not in the grant
        last.end_watches = True
        with pytest.raises(BrokerError):
            await prefill.command("transfer", last, 30)
        await dst.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=dst.engine_id, request_id=request_id,
                                                                reason="test"), timeout=10)
        ended = await asyncio.wait_for(watching, 10)
        assert ended.state == pb.TRANSFER_STATE_FAILED
        assert [s.state async for s in following] == [pb.TRANSFER_STATE_FAILED]
        assert_bytes(dst, before)
    finally:
        await decode.close()
        await prefill.close()


async def test_a_grant_command_is_refused_or_ends_at_its_deadline_as_its_two_calls_would(brokers, engines, request_id):
    """expect_watch refused as ExpectTransfer is (one error, the command's only reply); past its
    deadline the grant's watch ends DEADLINE_EXCEEDED while the grant lives on."""
    src = await engines.make(brokers.prefill, "prefill", seed=28)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    decode = stream(brokers.decode)
    try:
        bad = offer_request(dst, src, request_id, {MAIN: [7, 7]})
        with pytest.raises(BrokerError) as info:
            await anext(decode.expect_watch(bad, 30, 10))
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and "more than once" in str(info.value)
        following = decode.expect_watch(offer_request(dst, src, request_id, {MAIN: [7, 8]}), 0.5, 10)
        assert (await anext(following)).state == pb.TRANSFER_STATE_PENDING
        with pytest.raises(BrokerError) as info:
            await anext(following)
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        watcher = decode.watch(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id), 10)
        assert (await anext(watcher)).state == pb.TRANSFER_STATE_PENDING  # the grant lives on
        await watcher.aclose()
    finally:
        await decode.close()


async def test_a_watch_sends_each_part_each_state_or_only_the_end_as_asked(brokers, engines, request_id):
    """A request in three parts, watched on the decode broker six ways at once: a plain watch sees
    each part land (PENDING, TRANSFERRING twice, SUCCEEDED); a states_only one, as a call or on the
    Exchange stream, sees PENDING, TRANSFERRING, SUCCEEDED; a terminal_only one SUCCEEDED alone;
    each ends with the last status whole. The terminal_only watches are sent first, before the
    others' first statuses are awaited, so they follow the request from its start."""
    src = await engines.make(brokers.prefill, "prefill", seed=23)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    decode, prefill = stream(brokers.decode), stream(brokers.prefill)
    PENDING, MOVING, DONE = pb.TRANSFER_STATE_PENDING, pb.TRANSFER_STATE_TRANSFERRING, pb.TRANSFER_STATE_SUCCEEDED
    ways = {"end": {"terminal_only": True}, "all": {}, "states": {"states_only": True}}  # terminal_only first
    expected = {"all": [PENDING, MOVING, MOVING, DONE], "states": [PENDING, MOVING, DONE], "end": [DONE]}
    try:
        await decode.command("expect", offer_request(dst, src, request_id, {MAIN: [7, 8, 9]}), 10)
        watch = {way: bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=request_id, **options)
                 for way, options in ways.items()}
        calls = {way: dst.stub.WatchTransfer(request, timeout=30) for way, request in watch.items()}
        streamed = {way: decode.watch(request, 30) for way, request in watch.items()}
        seen = {(how, way): [] for how in ("call", "stream") for way in ways}
        for way in ("all", "states"):  # each of these watches has begun (its first status is the current one)
            seen[("call", way)].append((await calls[way].read()).status)
            seen[("stream", way)].append(await anext(streamed[way]))
        for i in range(3):
            await prefill.command("transfer", part_request(src, request_id, {MAIN: [i]}, offsets={MAIN: i},
                                                           last=i == 2), 30)
        for way, call in calls.items():
            seen[("call", way)] += await rest(call)
        for way, watching in streamed.items():
            seen[("stream", way)] += [s async for s in watching]
        for (how, way), statuses_seen in seen.items():
            assert [s.state for s in statuses_seen] == expected[way], (how, way, statuses_seen)
            assert statuses_seen[-1].parts == 3 and statuses_seen[-1].pages == 3
    finally:
        await decode.close()
        await prefill.close()


async def test_a_sender_watch_waits_for_the_offer_still_on_its_way(brokers, engines, request_id):
    """SGLang's decode sends its metadata frame while its offer travels: prefill's watch, sent before
    the offer reached its broker, waits for it there (offer_wait_ms) and follows it to the end."""
    src = await engines.make(brokers.prefill, "prefill", seed=24)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    decode, prefill = stream(brokers.decode), stream(brokers.prefill)
    try:
        before = dst.segment.array.copy()
        assert (await refusal(src.stub.WatchTransfer(bpb.WatchTransferRequest(
            engine_id=src.engine_id, request_id=request_id), timeout=10).read())).code() is grpc.StatusCode.NOT_FOUND
        await prefill.ping(10)  # the stream is open
        waiting = prefill.watch(bpb.WatchTransferRequest(engine_id=src.engine_id, request_id=request_id,
                                                         states_only=True, offer_wait_ms=30_000), 30)
        first = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0)  # one turn of the loop: the watch is written (or holds the write lock)
        await prefill.ping(10)  # read after the watch on the same stream: the watch waits at the broker now
        assert not first.done()
        await decode.command("expect", offer_request(dst, src, request_id, {MAIN: [7, 8, 9]}), 10)
        assert (await asyncio.wait_for(first, 30)).state == pb.TRANSFER_STATE_PENDING
        done = await prefill.command("transfer", part_request(src, request_id, {MAIN: [1, 2, 3]}), 30)
        assert done.transfer.status.state == pb.TRANSFER_STATE_SUCCEEDED
        assert [s.state async for s in waiting] == [pb.TRANSFER_STATE_TRANSFERRING, pb.TRANSFER_STATE_SUCCEEDED]
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [1, 2, 3], [7, 8, 9])]))
    finally:
        await decode.close()
        await prefill.close()


async def test_a_sender_watch_whose_offer_never_comes_is_not_found_after_its_wait(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", seed=25)
    prefill = stream(brokers.prefill)
    loop = asyncio.get_running_loop()
    try:
        for how in ("call", "stream"):
            request = bpb.WatchTransferRequest(engine_id=src.engine_id, request_id=request_id, offer_wait_ms=300)
            started = loop.time()
            if how == "call":
                error = await refusal(src.stub.WatchTransfer(request, timeout=10).read())
                assert error.code() is grpc.StatusCode.NOT_FOUND, how
            else:
                with pytest.raises(BrokerError) as info:
                    await anext(prefill.watch(request, 10))
                assert info.value.code is grpc.StatusCode.NOT_FOUND, how
            assert loop.time() - started >= 0.3, how  # it waited for the offer first
        # a wait past the caller's deadline ends before it: NOT_FOUND, not the caller's DEADLINE_EXCEEDED
        error = await refusal(src.stub.WatchTransfer(bpb.WatchTransferRequest(
            engine_id=src.engine_id, request_id=request_id, offer_wait_ms=60_000), timeout=1).read())
        assert error.code() is grpc.StatusCode.NOT_FOUND, error
    finally:
        await prefill.close()


async def test_a_sender_cancel_waits_for_the_offer_still_on_its_way_and_cancels_it(brokers, engines, request_id):
    """Prefill aborts after decode's frame came but maybe before its offer landed: the cancel waits
    for the offer (offer_wait_ms) and cancels it, so decode learns now, not at its grant's expiry."""
    src = await engines.make(brokers.prefill, "prefill", seed=26)
    dst = await engines.make(brokers.decode, "decode", fill="canary")
    decode = stream(brokers.decode)
    try:
        cancelling = asyncio.ensure_future(src.stub.CancelTransfer(bpb.CancelTransferRequest(
            engine_id=src.engine_id, request_id=request_id, reason="the client went away", offer_wait_ms=30_000),
            timeout=40))
        try:
            await decode.command("expect", offer_request(dst, src, request_id, {MAIN: [7, 8, 9]}), 10)
        except BrokerError as exc:  # the cancel may end the grant before its ExpectTransfer answers
            assert exc.code is grpc.StatusCode.CANCELLED, exc
        assert (await asyncio.wait_for(cancelling, 40)).status.state == pb.TRANSFER_STATE_FAILED
        seen = [s async for s in decode.watch(bpb.WatchTransferRequest(engine_id=dst.engine_id,
                                                                       request_id=request_id), 30)]
        assert seen[-1].state == pb.TRANSFER_STATE_FAILED and "the client went away" in seen[-1].reason
        assert seen[-1].code == CANCELLED
        loop = asyncio.get_running_loop()
        started = loop.time()
        error = await refusal(src.stub.CancelTransfer(bpb.CancelTransferRequest(
            engine_id=src.engine_id, request_id=request_id + "-never", offer_wait_ms=300), timeout=10))
        assert error.code() is grpc.StatusCode.NOT_FOUND and loop.time() - started >= 0.3
    finally:
        await decode.close()


async def test_a_refused_command_gets_the_code_and_message_of_its_unary_call(brokers, engines, request_id):
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=22)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    before = dst.segment.array.copy()
    await offer(dst, src, request_id, {MAIN: [1, 2, 3, 4], DENSE: [1, 2, 3, 4]})
    await part(src, request_id, {MAIN: [5, 6]}, last=False)
    refused = [
        ("transfer", src, part_request(src, request_id, {MAIN: [7]}, offsets={MAIN: 4}, last=False)),  # part-in-grant
        ("transfer", src, part_request(src, request_id, {MAIN: [7]}, offsets={MAIN: 1}, last=False)),  # overlap
        ("transfer", src, part_request(src, request_id, {MAIN: [7, 8], DENSE: [1, 2]}, offsets={MAIN: 2})),
        ("transfer", src, part_request(src, request_id, {MAIN: [SMALL.num_pages]}, offsets={MAIN: 2}, last=False)),
        ("transfer", src, bpb.TransferRequest(request_id=request_id, engine_id="no-such-engine/tp0")),
        ("expect", dst, bpb.ExpectTransferRequest(request_id=request_id, engine_id=dst.engine_id,
                                                  pages=[pb.ComponentPages(component=MAIN, page_ids=[1])])),
        ("expect", dst, offer_request(dst, src, request_id, {MAIN: [9, 9]})),
    ]
    exchange = {src.engine_id: stream(brokers.prefill), dst.engine_id: stream(brokers.decode)}
    unary = {"transfer": "Transfer", "expect": "ExpectTransfer"}
    try:
        for kind, engine, request in refused:
            expected = await refusal(getattr(engine.stub, unary[kind])(request, timeout=30))
            with pytest.raises(BrokerError) as got:
                await exchange[engine.engine_id].command(kind, request, 30)
            assert (got.value.code, got.value.reason) == (expected.code(), expected.details()), request
        with pytest.raises(BrokerError) as got:
            await statuses(exchange[dst.engine_id], dst, "no-such-request")
        expected = await refusal(watch_all(dst, "no-such-request"))
        assert (got.value.code, got.value.reason) == (expected.code(), expected.details())
        # the stream outlived its refusals, and so did the request
        done = await exchange[src.engine_id].command("transfer", part_request(
            src, request_id, {MAIN: [7, 8], DENSE: [1, 2, 3, 4]}, offsets={MAIN: 2}), 30)
        assert done.transfer.status.state == pb.TRANSFER_STATE_SUCCEEDED
        assert exchange[src.engine_id].streams_opened == 1
        assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [5, 6, 7, 8], [1, 2, 3, 4]),
                                                          (DENSE, [1, 2, 3, 4], [1, 2, 3, 4])]))
    finally:
        for each in exchange.values():
            await each.close()


async def test_a_stream_that_ends_fails_exactly_the_requests_it_carried(brokers, engines, request_id):
    """Carried: a request a part on the stream fed, and a grant an expect on it made; not carried: a
    request the same engines run over the unary calls, and one the stream only watched."""
    src = await engines.make(brokers.prefill, "prefill", components=M3, seed=23)
    dst = await engines.make(brokers.decode, "decode", components=M3, fill="canary")
    before = dst.segment.array.copy()
    fed, granted, bystander, watched = (f"{request_id}-{n}" for n in ("fed", "granted", "unary", "watched"))
    await offer(dst, src, fed, {MAIN: [1, 2, 3, 4]}, expiry_ms=10_000)  # without the end: FAILED at expiry
    await offer(dst, src, bystander, {MAIN: [11, 12, 13, 14]})
    await offer(dst, src, watched, {MAIN: [21, 22]})
    await part(src, bystander, {MAIN: [5, 6]}, last=False)
    prefill, decode = stream(brokers.prefill), stream(brokers.decode)
    try:
        await prefill.command("transfer", part_request(src, fed, {MAIN: [5, 6]}, last=False), 30)
        await decode.command("expect", offer_request(dst, src, granted, {MAIN: [31, 32]}), 10)
        watch = prefill.watch(bpb.WatchTransferRequest(engine_id=src.engine_id, request_id=watched), 30)
        assert (await anext(watch)).state == pb.TRANSFER_STATE_PENDING  # a watch carries no request
        await watch.aclose()
    finally:
        await prefill.close()
        await decode.close()
    for engine, rid in ((dst, fed), (src, fed), (dst, granted)):
        final = (await watch_all(engine, rid))[-1]
        assert final.state == pb.TRANSFER_STATE_FAILED and final.code == CANCELLED, (engine.engine_id, rid)
        assert END_REASON in final.reason
    done = await part(src, bystander, {MAIN: [7, 8]}, offsets={MAIN: 2})
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    done = await part(src, watched, {MAIN: [9, 10]})
    assert done.status.state == pb.TRANSFER_STATE_SUCCEEDED
    assert_bytes(dst, expect_pages(src, dst, before, [(MAIN, [5, 6], [1, 2]), (MAIN, [5, 6, 7, 8], [11, 12, 13, 14]),
                                                      (MAIN, [9, 10], [21, 22])]))


async def test_commands_past_a_bound_are_refused_each_on_its_own(backend, engines, request_id):
    bounded = await open_broker(f"exchange-bound-{backend}", backend, "--max-exchange-commands", "2",
                                "--max-pages-per-request", str(SMALL.num_pages))
    exchange = stream(bounded)
    try:
        dst = await engines.make(bounded, "decode", components=M3, fill="canary")
        for n in range(2):  # two claimed-flow grants; a watch of each stays in flight while they are PENDING
            await bounded.stub.ExpectTransfer(bpb.ExpectTransferRequest(
                request_id=f"{request_id}-{n}", engine_id=dst.engine_id, components=[MAIN], dst_page_ids=[n]),
                timeout=10)
        watches = [exchange.watch(bpb.WatchTransferRequest(engine_id=dst.engine_id, request_id=f"{request_id}-{n}"),
                                  30) for n in range(2)]
        for w in watches:
            assert (await anext(w)).state == pb.TRANSFER_STATE_PENDING
        with pytest.raises(ResourceExhausted) as refused:
            await exchange.ping(10)
        assert "max_exchange_commands=2" in refused.value.reason
        too_many = bpb.ExpectTransferRequest(request_id=f"{request_id}-x", engine_id=dst.engine_id, components=[MAIN],
                                             dst_page_ids=list(range(SMALL.num_pages + 1)))
        with pytest.raises(ResourceExhausted) as admitted:  # refused before it is read, and before the bound
            await exchange.command("expect", too_many, 10)
        expected = await refusal(bounded.stub.ExpectTransfer(too_many, timeout=10))
        assert (admitted.value.reason, expected.code()) == (expected.details(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "max_pages_per_request" in admitted.value.reason
        await bounded.stub.CancelTransfer(bpb.CancelTransferRequest(engine_id=dst.engine_id,
                                                                    request_id=f"{request_id}-0"), timeout=30)
        assert (await anext(watches[0])).state == pb.TRANSFER_STATE_FAILED
        await exchange.ping(10)  # the watch's slot came free with its last reply, on the same stream
        assert exchange.streams_opened == 1
        for w in watches:
            await w.aclose()
    finally:
        await exchange.close()
        await close_broker(bounded)


async def test_a_broker_without_the_stream_is_told_apart(brokers):
    """UNIMPLEMENTED (here: the peer port, which serves no BrokerService) means the unary RPCs."""
    channel = grpc.aio.insecure_channel(brokers.prefill.peer_address)
    exchange = Exchange(bpb_grpc.BrokerServiceStub(channel), brokers.prefill.peer_address)
    try:
        with pytest.raises(ExchangeUnsupported):
            await exchange.ping(10)
        assert exchange.supported is False
        with pytest.raises(ExchangeUnsupported):
            await exchange.ping(10)
    finally:
        await exchange.close()
        await channel.close()
