"""The OfferBook: offers found by request id, receiver and engine, waited for with a bound, ended
once, held to quotas per peer (a certified identity, or a host) and in total; PeerCalls, the peer
servicer's call quota."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.identity import PeerIdentity
from kvbroker.core.model import Component
from kvbroker.edge.trust import PeerCalls
from kvbroker.flows.offers import Offer, OfferBook, OfferQuota, offer_bytes

MAIN = Component.MAIN_KV


def offer(request_id="r1", sender_engine_id="", expires_in=30.0, receiver="decode-0", pages=4,
          quota_key="") -> Offer:
    now = asyncio.get_running_loop().time()
    return Offer("127.0.0.1:1", receiver, 7, "decode/e", request_id, sender_engine_id, {MAIN: np.arange(pages)},
                 "t" * 32, 1, now + expires_in, quota_key=quota_key)


async def test_an_offer_naming_no_engine_becomes_the_first_takers():
    book = OfferBook(8)
    book.add(offer())
    taken = await book.take("r1", "prefill/e0", timeout=0)
    assert taken.sender_engine_id == "prefill/e0"
    assert book.find("r1", "prefill/e1") is None and book.find("r1", "prefill/e0") is taken


async def test_a_named_offer_is_only_for_its_engine():
    book = OfferBook(8)
    book.add(offer(sender_engine_id="prefill/e0"))
    with pytest.raises(BrokerError) as info:
        await book.take("r1", "prefill/e1", timeout=0)
    assert info.value.code is Code.NOT_FOUND


async def test_take_waits_for_an_offer_that_arrives_later():
    book = OfferBook(8)
    waiting = asyncio.create_task(book.take("r1", "prefill/e0", timeout=30))
    await asyncio.sleep(0)  # the taker is parked on its waiter
    assert not waiting.done()
    book.add(offer())
    assert (await asyncio.wait_for(waiting, 5)).request_id == "r1"


async def test_an_offer_after_the_taker_gave_up_is_refused_once():
    book = OfferBook(8)
    with pytest.raises(BrokerError) as info:
        await book.take("r1", "prefill/e0", timeout=0.01)
    assert info.value.code is Code.NOT_FOUND and "offer_wait_s" in info.value.reason
    with pytest.raises(BrokerError) as late:
        book.add(offer())
    assert late.value.code is Code.FAILED_PRECONDITION and "gave up" in late.value.reason
    book.add(offer())  # the note is spent: a retry of the request is offered normally


async def test_bounds_and_duplicates():
    book = OfferBook(1)
    book.add(offer("r1"))
    with pytest.raises(BrokerError) as dup:
        book.add(offer("r1"))
    assert dup.value.code is Code.ALREADY_EXISTS
    with pytest.raises(BrokerError) as full:
        book.add(offer("r2"))
    assert full.value.code is Code.RESOURCE_EXHAUSTED and "max_offers" in full.value.reason


async def test_expiry_ends_the_offer_and_tells_the_owner():
    expired = asyncio.Event()
    book = OfferBook(8, on_expired=lambda o: expired.set())
    held = offer(expires_in=0.01)
    book.add(held)
    await asyncio.wait_for(expired.wait(), 5)
    assert held.ended is not None and held.ended.code is Code.DEADLINE_EXCEEDED and len(book) == 0
    with pytest.raises(BrokerError):
        held.begin_part(last=False)


async def test_parts_are_numbered_and_nothing_follows_the_last():
    held = offer()
    assert held.begin_part(last=False) == 0 and held.begin_part(last=True) == 1
    with pytest.raises(BrokerError) as info:
        held.begin_part(last=False)
    assert "last part (part 1)" in info.value.reason
    assert not held.quiesced.is_set()
    held.end_part()
    held.end_part()
    assert held.quiesced.is_set() and held.done


async def test_close_wakes_a_waiting_taker_with_unavailable():
    book = OfferBook(8)
    waiting = asyncio.create_task(book.take("r1", "prefill/e0", timeout=30))
    await asyncio.sleep(0)  # parked on its waiter
    book.close()
    with pytest.raises(BrokerError) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.code is Code.UNAVAILABLE


async def test_two_receivers_offers_of_one_request_id_are_kept_apart():
    book = OfferBook(8)
    squat, real = offer(receiver="decode-squat"), offer(receiver="decode-real")
    book.add(squat)
    book.add(real)  # another key: not ALREADY_EXISTS
    with pytest.raises(BrokerError) as info:
        book.add(offer(receiver="decode-real", sender_engine_id="prefill/e0"))
    assert info.value.code is Code.ALREADY_EXISTS  # the same receiver's offer naming no engine covers it
    with pytest.raises(BrokerError) as ambiguous:
        book.find("r1", "prefill/e0")
    assert ambiguous.value.code is Code.FAILED_PRECONDITION and "receiver_broker_id" in ambiguous.value.reason
    assert await book.take("r1", "prefill/e0", timeout=0, receiver_id="decode-real") is real
    assert book.rivals(real) == [squat]
    book.end(squat, BrokerError(Code.FAILED_PRECONDITION, "lost"))
    assert book.find("r1", "prefill/e0") is real  # one left: a part naming no receiver takes it


async def test_quotas_per_receiver_and_in_total_name_their_setting():
    quota = OfferQuota(max_offers=100, max_offers_per_peer=100, max_offer_pages=10, max_offer_pages_per_peer=6,
                       max_offer_bytes=1 << 30, max_offer_bytes_per_peer=offer_bytes(4) + offer_bytes(1))
    book = OfferBook(quota)
    book.add(offer("a", receiver="p", pages=4))
    for pages, name in ((3, "max_offer_pages_per_peer"), (2, "max_offer_bytes_per_peer")):
        with pytest.raises(BrokerError) as info:
            book.admit("p", pages)
        assert info.value.code is Code.RESOURCE_EXHAUSTED and f"({name})" in info.value.reason
    book.add(offer("b", receiver="q", pages=6))
    with pytest.raises(BrokerError) as total:
        book.add(offer("c", receiver="r", pages=1))
    assert "(max_offer_pages)" in total.value.reason and book.held() == (2, 10, offer_bytes(4) + offer_bytes(6))
    book.end(book.find("b", "e", "q"), BrokerError(Code.CANCELLED, "gone"))
    assert book.held("q") == (0, 0, 0)
    book.add(offer("c", receiver="r", pages=1))  # room again once one ended


async def test_a_stranger_changing_names_is_one_peer_of_its_host_and_a_certified_one_is_its_own():
    """Without mutual TLS a broker id is only a claim: offers count against the host they came from."""
    book = OfferBook(OfferQuota(max_offers=100, max_offers_per_peer=2))
    names = iter(f"stranger-{i}" for i in range(10))
    for i in range(2):
        liar = PeerIdentity(next(names), False, "ipv4:10.0.0.9")
        book.add(offer(f"r{i}", receiver=liar.name, quota_key=liar.quota_key))
    third = PeerIdentity(next(names), False, "ipv4:10.0.0.9")
    with pytest.raises(BrokerError) as refused:
        book.admit(third.quota_key, 1)
    assert "host ipv4:10.0.0.9" in refused.value.reason and "(max_offers_per_peer)" in refused.value.reason
    honest = PeerIdentity("decode-1", False, "ipv4:10.0.0.10")  # another host keeps its own room
    book.add(offer("r9", receiver=honest.name, quota_key=honest.quota_key))
    certified = [PeerIdentity("decode-2", True, "ipv4:10.0.0.9"), PeerIdentity("decode-3", True, "ipv4:10.0.0.9")]
    assert len({c.quota_key for c in certified}) == 2  # identities a CA certified count apart, whatever host
    assert book.held("host ipv4:10.0.0.9")[0] == 2 and book.held("host ipv4:10.0.0.10")[0] == 1


def test_peer_calls_are_bounded_per_identity_and_in_total():
    calls = PeerCalls(total=3, per_peer=2)
    calls.enter("a")
    calls.enter("a")
    with pytest.raises(BrokerError) as mine:
        calls.enter("a")
    assert mine.value.code is Code.RESOURCE_EXHAUSTED and "max_peer_calls_per_peer" in mine.value.reason
    calls.enter("b")
    with pytest.raises(BrokerError) as total:
        calls.enter("c")
    assert "(max_peer_calls)" in total.value.reason
    calls.leave("a")
    calls.enter("c")
