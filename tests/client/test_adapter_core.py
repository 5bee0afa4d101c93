"""The adapter core (kvbroker_client.adapter) driving both roles with no engine: an EngineLink per
side on two real brokers, a ReceivingRequest offering its grant, a SendingRequest sending parts into
it, and what each reports: phases, failures with the broker's code, the aux, the quiesced mark."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from kvbroker_client import Component
from kvbroker_client.adapter import AdapterSettings, EngineLink, Part, Phase, ReceivingRequest, SendingRequest
from kvbroker_client.adapter.request import Request
from tests.support.pool_engines import PoolEngine, pool_engine
from tests.support.pools import CALL_TIMEOUT_S, assert_pool_equals, expected_destination, unique

pytestmark = pytest.mark.integration
SETTLE_S = 30.0  # every wait of these tests is bounded by this


class Phases:
    """The phases a request went through, as on_change saw them (on the link's loop)."""

    def __init__(self) -> None:
        self.seen: list[Phase] = []
        self._changed = threading.Condition()

    def __call__(self, request: Request) -> None:
        with self._changed:
            self.seen.append(request.phase)
            self._changed.notify_all()

    def until_terminal(self) -> list[Phase]:
        with self._changed:
            assert self._changed.wait_for(lambda: self.seen and self.seen[-1].terminal, SETTLE_S), self.seen
            return list(self.seen)

    def until(self, phase: Phase) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: phase in self.seen, SETTLE_S), self.seen


async def link_for(broker, engine: PoolEngine) -> EngineLink:
    settings = AdapterSettings(address=broker.listen, call_timeout_s=CALL_TIMEOUT_S, connect_timeout_s=CALL_TIMEOUT_S)
    link = EngineLink(settings, engine.engine_id, holder="adapter core test")
    await asyncio.to_thread(link.open, engine.topology, engine.components)
    return link


@pytest.fixture
async def links(client_brokers, pools):
    """A prefill engine with random pages and a decode engine of canaries, each on its broker by a link."""
    src = pool_engine(pools, unique("core-prefill"), fill="random", seed=5)
    dst = pool_engine(pools, unique("core-decode"), fill="canary")
    prefill, decode = await link_for(client_brokers.prefill, src), await link_for(client_brokers.decode, dst)
    yield src, dst, prefill, decode
    await asyncio.gather(asyncio.to_thread(prefill.close), asyncio.to_thread(decode.close))


async def test_both_roles_move_a_request_in_two_parts_with_its_aux(links):
    src, dst, prefill, decode = links
    before = dst.pool.bytes.copy()
    src_ids, dst_ids = np.array([3, 4, 5, 9, 10, 11]), np.array([20, 21, 22, 7, 8, 1])
    sent, landed = Phases(), Phases()
    aux_taken: list[bytes] = []
    receiving = ReceivingRequest(decode, unique("req"), on_change=landed)
    sending = SendingRequest(prefill, receiving.request_id, on_change=sent)

    receiving.grant({Component.MAIN_KV: dst_ids, Component.MINIMAX_INDEX_K: dst_ids},
                    sender_address=prefill.broker_address, sender_engine_id=src.engine_id, expiry_s=60,
                    accept_aux=aux_taken.append)
    sending.expect_offer()
    ready = threading.Event()
    sending.send_part(Part({Component.MAIN_KV: src_ids[:3]}, last=False, ready=ready.wait,
                           receiver_broker_id=decode.broker_id))
    sending.send_part(Part({Component.MAIN_KV: src_ids[3:], Component.MINIMAX_INDEX_K: src_ids}, last=True,
                           dst_offsets={Component.MAIN_KV: 3}, aux=b"first token", receiver_broker_id=decode.broker_id))
    await asyncio.sleep(0)
    assert sending.phase is Phase.OPEN, "a part waits for the engine's pages before it goes"
    ready.set()

    # the receiver's one command: the grant's answer, then its end (a landed part costs no message)
    assert await asyncio.to_thread(landed.until_terminal) == [Phase.WAITING, Phase.SUCCEEDED]
    assert await asyncio.to_thread(sent.until_terminal) == [Phase.TRANSFERRING, Phase.SUCCEEDED]  # each part's reply
    assert aux_taken == [b"first token"] and receiving.aux == b"first token"
    assert sending.final is not None and sending.final.bytes > 0 and sending.parts_sent == 2
    assert not sending.holding and not receiving.holding and receiving.failure is None
    expected = expected_destination(src.pool, dst.pool, before, src.components, dst.components, src_ids, dst_ids)
    assert_pool_equals(dst.pool, expected)


async def test_a_receivers_cancel_fails_both_with_the_brokers_code_and_quiesces(links):
    src, dst, prefill, decode = links
    landed, sent = Phases(), Phases()
    receiving = ReceivingRequest(decode, unique("req"), on_change=landed)
    sending = SendingRequest(prefill, receiving.request_id, on_change=sent)
    receiving.grant({Component.MAIN_KV: np.arange(4)}, sender_address=prefill.broker_address,
                    sender_engine_id=src.engine_id, expiry_s=60)
    sending.expect_offer()
    assert receiving.cancel("decode aborted") is not None
    assert receiving.cancel("twice") is None, "a request is cancelled once"
    await asyncio.to_thread(receiving.wait_quiesced, SETTLE_S)
    assert (await asyncio.to_thread(landed.until_terminal))[-1] is Phase.FAILED  # (after WAITING, if it came)
    assert receiving.failure.code is grpc.StatusCode.CANCELLED and "decode aborted" in receiving.failure.reason
    await asyncio.to_thread(sent.until_terminal)
    # the sender's watch sees the revoked offer: its record failed (CANCELLED), or was never made (NOT_FOUND)
    assert sending.phase is Phase.FAILED, sending.failure
    assert sending.failure.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND), sending.failure
    quiesced = threading.Event()
    receiving.when_quiesced(quiesced.set)
    assert quiesced.is_set() and not receiving.holding


async def test_a_sender_that_ended_before_the_offer_refuses_it_when_it_lands(links):
    src, dst, prefill, decode = links
    landed = Phases()
    request_id = unique("req")
    refused = SendingRequest(prefill, request_id).refuse_offer("prefill aborted it first")
    assert refused is not None
    receiving = ReceivingRequest(decode, request_id, on_change=landed)
    receiving.grant({Component.MAIN_KV: np.arange(4)}, sender_address=prefill.broker_address,
                    sender_engine_id=src.engine_id, expiry_s=120)
    phases = await asyncio.to_thread(landed.until_terminal)
    assert phases[-1] is Phase.FAILED and "prefill aborted it first" in receiving.failure.reason
    assert receiving.failure.code is grpc.StatusCode.CANCELLED


async def test_a_part_refused_by_the_broker_fails_the_sender_with_its_code_and_words(links):
    src, dst, prefill, decode = links
    sent, granted = Phases(), Phases()
    receiving = ReceivingRequest(decode, unique("req"), on_change=granted)
    sending = SendingRequest(prefill, receiving.request_id, on_change=sent)
    receiving.grant({Component.MAIN_KV: np.arange(2)}, sender_address=prefill.broker_address,
                    sender_engine_id=src.engine_id, expiry_s=60)
    await asyncio.to_thread(granted.until, Phase.WAITING)  # the offer landed: the part is judged, not waited for
    sending.send_part(Part({Component.MAIN_KV: np.array([1, 10_000])}, last=True))  # a page past the pool
    assert await asyncio.to_thread(sent.until_terminal) == [Phase.FAILED]
    assert sending.failure.code is grpc.StatusCode.INVALID_ARGUMENT, sending.failure
    assert sending.failure.reason.startswith("kvbroker INVALID_ARGUMENT: ") and "10000" in sending.failure.reason
    await asyncio.to_thread(sending.wait_quiesced, SETTLE_S)  # the part was sent: its cancel answers
    assert not sending.holding


def test_phases_only_rise_and_the_first_failure_wins_its_code_filled_later():
    link = EngineLink(AdapterSettings(), "never-opened", holder="test")  # nothing reaches a broker
    changes = Phases()
    request = SendingRequest(link, "r", on_change=changes)
    request.rise(Phase.TRANSFERRING)
    request.rise(Phase.WAITING)
    request.fail("the engine gave up")
    request.fail("later words", grpc.StatusCode.CANCELLED)
    request.rise(Phase.SUCCEEDED)
    assert changes.seen == [Phase.TRANSFERRING, Phase.FAILED]
    assert (request.failure.reason, request.failure.code) == ("the engine gave up", grpc.StatusCode.CANCELLED)
    done = SendingRequest(link, "s")
    done.rise(Phase.SUCCEEDED)
    done.fail("too late")
    assert done.phase is Phase.SUCCEEDED and done.failure is None
    assert done.cancel("nothing offered") is None and not done.holding


@pytest.fixture
async def impatient_links(brokers_of_test, pools):
    """As `links`, on brokers of the test's own whose offer wait is short (offer_wait_s 0.3)."""
    prefill_broker = await brokers_of_test.start("--offer-wait-s", "0.3")
    decode_broker = await brokers_of_test.start("--offer-wait-s", "0.3")
    src = pool_engine(pools, unique("core-prefill"), fill="random", seed=8)
    dst = pool_engine(pools, unique("core-decode"), fill="canary")
    prefill, decode = await link_for(prefill_broker, src), await link_for(decode_broker, dst)
    yield src, dst, prefill, decode
    await asyncio.gather(asyncio.to_thread(prefill.close), asyncio.to_thread(decode.close))


def ended_event(request: Request) -> threading.Event:
    ended = threading.Event()
    request.when_ended(lambda _: ended.set())
    return ended


async def test_a_sender_that_finished_first_holds_for_an_offer_later_than_the_brokers_wait(impatient_links):
    """vLLM's order: prefill's one part waits for decode's offer longer than the broker waits for it
    (watched again until hold_s); decode grants only its uncached suffix (src_offset)."""
    src, dst, prefill, decode = impatient_links
    before = dst.pool.bytes.copy()
    src_ids, held = np.array([2, 3, 4, 5, 6, 7]), 2
    dst_ids = np.array([11, 12, 13, 14])
    sent = Phases()
    sending = SendingRequest(prefill, unique("req"), on_change=sent)
    sender_ended = ended_event(sending)
    sending.send_when_offered(Part({Component.MAIN_KV: src_ids}, last=True), hold_s=60)
    await asyncio.sleep(1.0)  # the offer comes after the broker's own wait (0.3 s) has run out three times
    assert sending.phase is Phase.OPEN and not sender_ended.is_set()
    receiving = ReceivingRequest(decode, sending.request_id)
    receiver_ended = ended_event(receiving)
    receiving.grant({Component.MAIN_KV: dst_ids}, sender_address=prefill.broker_address,
                    sender_engine_id=src.engine_id, expiry_s=60, src_offsets={Component.MAIN_KV: held})
    phases = await asyncio.to_thread(sent.until_terminal)
    assert phases[0] is Phase.WAITING and phases[-1] is Phase.SUCCEEDED, phases  # (TRANSFERRING, if seen)
    assert await asyncio.to_thread(sender_ended.wait, SETTLE_S)
    assert await asyncio.to_thread(receiver_ended.wait, SETTLE_S) and receiving.phase is Phase.SUCCEEDED
    main_kv = [c for c in dst.components if c.component is Component.MAIN_KV]  # the only component granted
    expected = expected_destination(src.pool, dst.pool, before, src.components, main_kv, src_ids[held:], dst_ids)
    assert_pool_equals(dst.pool, expected)


async def test_a_sender_whose_hold_ran_out_fails_ends_and_refuses_the_offer_that_comes_then(impatient_links):
    src, dst, prefill, decode = impatient_links
    sending = SendingRequest(prefill, unique("req"))
    sender_ended = ended_event(sending)
    sending.send_when_offered(Part({Component.MAIN_KV: np.arange(3)}, last=True), hold_s=0.5)
    assert await asyncio.to_thread(sender_ended.wait, SETTLE_S)
    assert sending.phase is Phase.FAILED and sending.failure.code is grpc.StatusCode.NOT_FOUND, sending.failure
    landed = Phases()
    receiving = ReceivingRequest(decode, sending.request_id, on_change=landed)
    receiving.grant({Component.MAIN_KV: np.arange(3)}, sender_address=prefill.broker_address,
                    sender_engine_id=src.engine_id, expiry_s=60)
    assert (await asyncio.to_thread(landed.until_terminal))[-1] is Phase.FAILED
    assert receiving.failure.code is grpc.StatusCode.FAILED_PRECONDITION, receiving.failure
    assert "gave up waiting for the offer" in receiving.failure.reason
