"""The domain classes in process: the Broker façade, the OfferIntake and the send step, against a
fake PeerLink and a fake Backend (pure logic: no engine, no gRPC). Byte moving is the integration
tests' (tests/integration), with real brokers and engines."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from kvbroker.backends.base import Backend
from kvbroker.config import Settings
from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.identity import PeerIdentity
from kvbroker.core.model import Component, TransferState
from kvbroker.flows.broker import Broker
from kvbroker.flows.limits import Limits
from kvbroker.flows.send_step import SendJob, failure
from kvbroker.peers.link import GrantOffer, PartAck, PartNotice
from tests.support.helpers import refusal

TOKEN = "ab" * 16
DECODE = PeerIdentity("decode-1", False)


class FakeBackend(Backend):
    name = "fake"

    async def start(self) -> None: ...
    async def register(self, regions): return object()
    async def deregister(self, handle) -> None: ...
    async def metadata(self) -> bytes: return b"meta"
    def is_own(self, metadata: bytes) -> bool: return metadata == b"meta"
    async def connect(self, metadata: bytes): return object()
    async def disconnect(self, handle) -> None: ...
    async def write(self, peer, descriptors, timeout: float) -> None: ...
    def writing(self, peer) -> bool: return False
    async def close(self) -> None: ...


PEER = SimpleNamespace(address="127.0.0.1:50052", broker_id="decode-1", epoch=3, handshakes=2)


class FakePeers:
    """A PeerLink that records what the domain asked of its peers; sessions never come."""

    def __init__(self) -> None:
        self.sessions: list[tuple[str, str]] = []
        self.notices: list[tuple[str, PartNotice]] = []
        self.asked = asyncio.Event()

    async def session(self, address, engine_id, *, refresh, timeout, expect=""):
        self.sessions.append((address, engine_id))
        self.asked.set()
        raise BrokerError(Code.UNAVAILABLE, f"peer broker {address}: not reachable (fake)")

    async def claim(self, session, request_id, components, dst_page_ids, timeout):
        raise AssertionError("no claim expected")

    async def complete(self, address, engine_id, request_id, claim_token, status, timeout):
        raise AssertionError("no completion expected")

    async def offer(self, address, offer, timeout):
        raise AssertionError("no offer expected")

    async def revoke(self, address, engine_id, request_id, token, code, reason, timeout):
        return True

    async def notify(self, address, notice):
        self.notices.append((address, notice))
        return PartAck(TransferState.FAILED)

    records = {"127.0.0.1:50052": PEER}


@pytest.fixture
async def domain():
    peers = FakePeers()
    broker = Broker("prefill-1", 7, FakeBackend(), Limits.from_settings(Settings(), peer_rpc_timeout_s=1.0), peers,
                    peer_address="127.0.0.1:1")
    yield broker, peers
    await broker.close()


def never(*args):
    raise AssertionError("the command was converted before the engine was looked up")


async def test_an_unknown_engine_is_not_found_before_any_page_list_is_converted(domain):
    broker, _ = domain
    for call in (broker.transfer("nope", never, None), broker.expect_transfer("nope", never)):
        with pytest.raises(BrokerError) as info:
            await call
        assert info.value.code is Code.NOT_FOUND and "nope" in info.value.reason
    assert refusal(broker.claim, DECODE, "nope", "r1", never).code is Code.NOT_FOUND
    assert refusal(broker.receive_offer, DECODE, "nope", 4, never, 3).code is Code.NOT_FOUND


async def test_a_handshake_for_another_backend_names_the_rule(domain):
    broker, _ = domain
    with pytest.raises(BrokerError) as info:
        await broker.handshake("nixl", "e0")
    assert info.value.code is Code.FAILED_PRECONDITION and "backend: caller uses 'nixl'" in info.value.reason


def grant_offer(request_id="r1", token=TOKEN) -> GrantOffer:
    return GrantOffer("127.0.0.1:2", "d0", request_id, "", {Component.MAIN_KV: np.arange(4)}, 30.0, token, 1)


async def test_an_offer_is_held_handshaken_ahead_and_revoked_only_with_its_token(domain):
    broker, peers = domain
    broker.receive_offer(DECODE, "", 4, lambda max_pages: grant_offer(), 3)
    offer = broker.offers.book.by_receiver("decode-1", "d0", "r1")
    assert offer is not None and offer.ended is None
    await asyncio.wait_for(peers.asked.wait(), 5)  # the handshake made ahead, for the first part
    assert peers.sessions == [("127.0.0.1:2", "d0")]
    with pytest.raises(BrokerError) as info:
        await broker.revoke_offer(DECODE, "d0", "r1", "cd" * 16, int(Code.CANCELLED), "no", 1.0)
    assert info.value.code is Code.PERMISSION_DENIED and offer.ended is None
    assert await broker.revoke_offer(DECODE, "d0", "r1", TOKEN, int(Code.CANCELLED), "changed my mind", 1.0)
    assert offer.revoked and "changed my mind" in offer.ended.reason


async def test_the_drain_ends_held_offers_and_tells_each_receiver(domain):
    broker, peers = domain
    broker.receive_offer(DECODE, "", 4, lambda max_pages: grant_offer("r2"), 3)
    await broker.drain(grace_s=0.1)
    [(address, notice)] = peers.notices
    assert address == "127.0.0.1:2" and notice.request_id == "r2" and not notice.succeeded
    assert notice.code == Code.UNAVAILABLE and "shut down" in notice.reason
    assert refusal(broker.receive_offer, DECODE, "", 4, lambda max_pages: grant_offer("r3"), 3).code is Code.UNAVAILABLE


async def test_a_watch_waiting_for_an_offer_ends_not_found_when_the_broker_stops(domain):
    broker, _ = domain
    waiting = asyncio.ensure_future(broker.watch("p0", "r1", offer_wait_s=30))
    await asyncio.sleep(0)  # it waits in the offer book
    assert not waiting.done()
    loop = asyncio.get_running_loop()
    started = loop.time()
    broker.offers.book.close()
    with pytest.raises(BrokerError) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.code is Code.NOT_FOUND
    assert loop.time() - started < 5  # at once: not its offer_wait_s spinning on a closed book, loop blocked


async def test_the_broker_info_names_the_peers_its_peer_link_knows(domain):
    broker, _ = domain
    info = broker.info()
    assert info.peers == [PEER]
    assert (info.broker_id, info.epoch, info.peer_address) == ("prefill-1", 7, "127.0.0.1:1")


async def test_a_notice_for_a_grant_this_broker_does_not_hold_is_not_found(domain):
    broker, _ = domain
    [ack] = broker.take_notices(DECODE, [PartNotice("d0", "r9", TOKEN, 0, 1, True)])
    assert ack.state is None and ack.code == Code.NOT_FOUND


async def test_the_send_steps_budget_is_the_callers_deadline_or_the_limit():
    budget, caller_bound, _ = SendJob.budget_for(None, 60.0)
    assert (budget, caller_bound) == (60.0, False)
    budget, caller_bound, _ = SendJob.budget_for(2.0, 60.0)
    assert (budget, caller_bound) == (2.0, True)
    assert SendJob.budget_for(90.0, 60.0)[:2] == (60.0, False)


@pytest.mark.parametrize("caller_bound, code", [(True, Code.DEADLINE_EXCEEDED), (False, Code.UNAVAILABLE)])
async def test_a_job_out_of_time_fails_with_whose_deadline_it_was(caller_bound, code):
    job = SendJob("e0", None, 2.0, caller_bound, 0.0)
    cancelled = BrokerError(Code.CANCELLED, "cancelled")
    error = failure(TimeoutError(), job, "transfer", "r1", cancelled)
    assert error.code is code and "transfer did not complete within 2.000s" in error.reason
    assert failure(asyncio.CancelledError(), job, "transfer", "r1", cancelled) is cancelled
    refused = BrokerError(Code.PERMISSION_DENIED, "no")
    assert failure(refused, job, "transfer", "r1", cancelled) is refused
    bug = failure(KeyError("x"), job, "transfer", "r1", cancelled)
    assert bug.code is Code.INTERNAL and "KeyError" in bug.reason
