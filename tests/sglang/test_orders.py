"""The orders of events a real PD deployment produces, reproduced deterministically on real brokers, and
the KVPoll states each of SGLang's queues accepts, read from SGLang 0.5.23's own source.

    decode's metadata frame before SGLang made the prefill sender (the router posts to both servers at
        once): the frame opens the room, the sender joins it, every byte lands
    decode aborts a request still in prefill's bootstrap queue while the prefill broker is slow to
        answer the cancel (paused): prefill's poll() stays in what pop_bootstrapped accepts
    every phase (prefill's bootstrap and inflight queues, decode's prealloc and transfer queues) with an
        abort on either side while a broker is paused: every state poll() returns is one that queue takes
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import os
import signal
import textwrap
import time

import grpc
import pytest

from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender
from tests.support.sglang_pair import (
    CHUNKS,
    PAGES,
    POLL_TIMEOUT_S,
    PREFILL_AUX,
    PREFIX_PAGES,
    Watched,
    assert_decode_bytes,
    expected_decode,
    failure,
    make_pair,
    new_request,
    polls,
    send_chunk,
    send_decode_metadata,
    snapshot,
    start,
)

pytestmark = pytest.mark.integration


# -- what SGLang's queues accept -------------------------------------------------------------------

def _poll_names(test: ast.expr) -> set[str] | None:
    """The KVPoll members `test` compares `poll` with (== or in), or None when it is no such test."""
    if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "poll"
            and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.In))):
        return None
    (right,) = test.comparators
    items = right.elts if isinstance(right, (ast.List, ast.Tuple, ast.Set)) else [right]
    if not all(isinstance(i, ast.Attribute) and isinstance(i.value, ast.Name) and i.value.id == "KVPoll"
               for i in items):
        return None
    return {i.attr for i in items}


def accepted_polls(function) -> frozenset[str]:
    """The KVPoll states an SGLang queue takes from poll(): its if/elif chain on `poll` whose else raises."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    chains = []
    for node in ast.walk(tree):
        names, tail = set(), node
        while isinstance(tail, ast.If) and (found := _poll_names(tail.test)) is not None:
            names |= found
            if len(tail.orelse) == 1 and isinstance(tail.orelse[0], ast.If):
                tail = tail.orelse[0]
                continue
            if tail.orelse and isinstance(tail.orelse[-1], ast.Raise):
                chains.append(frozenset(names))
            break
    assert chains, f"{function.__qualname__}: no if/elif chain on poll that raises on the rest"
    return max(chains, key=len)  # the whole chain; its elif tails are chains too


def sglang_queues() -> dict[str, frozenset[str]]:
    """Per phase of a request, what every SGLang queue that polls it in that phase accepts."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin

    prefill = SchedulerDisaggregationPrefillMixin
    return {
        # before the sender's first part: the bootstrap queue, and (optimistic prefill) the same sender
        # polled while pending bootstrap in the inflight queue and the chunked path (check_bootstrap)
        "prefill bootstrap": accepted_polls(PrefillBootstrapQueue.pop_bootstrapped)
        & accepted_polls(prefill.handle_pending_bootstrap),
        "prefill inflight": accepted_polls(prefill.process_disagg_prefill_inflight_queue),
        "decode prealloc": accepted_polls(DecodePreallocQueue._update_handshake_waiters),
        "decode transfer": accepted_polls(DecodeTransferQueue.pop_transferred),
    }


def test_sglangs_queues_accept_what_clients_readme_says(sglang_process):
    assert sglang_queues() == {
        "prefill bootstrap": {"Failed", "Bootstrapping", "WaitingForInput"},
        "prefill inflight": {"WaitingForInput", "Transferring", "Success", "Failed"},
        "decode prealloc": {"Bootstrapping", "WaitingForInput", "Failed"},
        "decode transfer": {"Failed", "Success", "Bootstrapping", "WaitingForInput", "Transferring"},
    }


def assert_accepted(watched: Watched, phase: str) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    names = {next(n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
                  if getattr(KVPoll, n) == state) for state in watched.seen}
    takes = sglang_queues()[phase]
    assert names <= takes, f"{type(watched.side).__name__} showed {sorted(names)} in the {phase} phase; SGLang's " \
                           f"queue there takes {sorted(takes)}"


@contextlib.contextmanager
def paused(broker):
    """The broker answers nothing (SIGSTOP) until the block ends: its answers come after what the block does."""
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(broker.pid, signal.SIGCONT)


def until(predicate, what: str, timeout: float = POLL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)  # the scheduler's next loop iteration


def _poll(name: str):
    return polls(name)[0]


def _finish(pair, sender: Watched, receiver: Watched, request) -> None:
    sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
    for i in range(len(CHUNKS)):
        send_chunk(pair, sender, request, i)
    assert sender.until(_poll("Success"), _poll("Failed")) == _poll("Success"), sender.seen
    assert receiver.until(_poll("Success"), _poll("Failed")) == _poll("Success"), receiver.seen


# -- the race: decode's metadata before the sender ----------------------------------------------------

async def test_decodes_metadata_before_the_prefill_sender_exists_still_moves_every_byte(sglang_ranks, engine_brokers):
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(31)
    before = snapshot(pair)

    def run():
        receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, request.room))
        send_decode_metadata(pair, request, receiver)
        until(lambda: request.room in pair.prefill.transfer_infos, "decode's metadata frame never reached prefill")
        # SGLang has no sender for the room yet; the frame opens it, and the offer is watched
        until(lambda: pair.prefill.request_status.get(request.room) == _poll("WaitingForInput"),
              "the metadata frame that came before the sender opened no room: nothing watches the offer", 20)
        sender = Watched(KvbrokerKVSender(pair.prefill, pair.bootstrap, request.room))
        assert sender.until(_poll("WaitingForInput"), _poll("Failed"), timeout=20) == _poll("WaitingForInput")
        assert_accepted(sender, "prefill bootstrap")
        _finish(pair, sender, receiver, request)
        return sender, receiver

    sender, receiver = await asyncio.to_thread(run)
    assert_decode_bytes(pair, expected_decode(pair, request, before, len(CHUNKS)))
    sender.side.clear(), receiver.side.clear()
    assert request.room not in pair.prefill._rooms and request.room not in pair.prefill.request_status


async def test_a_room_decode_opened_and_no_sender_joined_is_dropped_when_its_offer_ends(sglang_ranks, broker_pair):
    """A request prefill never makes a sender for (e.g. refused before its bootstrap queue): decode's
    abort ends the offer, and the room its frame opened does not stay behind."""
    prefill_broker, decode_broker = broker_pair
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(32)

    def run():
        receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, request.room))
        send_decode_metadata(pair, request, receiver)
        until(lambda: pair.prefill.request_status.get(request.room) == _poll("WaitingForInput"),
              "the metadata frame opened no room", 20)
        receiver.side.abort()
        receiver.until(_poll("Failed"))
        until(lambda: request.room not in pair.prefill.request_status, "the room decode opened stayed behind")

    await asyncio.to_thread(run)
    assert request.room not in pair.prefill._rooms and request.room not in pair.prefill.transfer_infos


# -- the crash: decode aborts a request in prefill's bootstrap queue ------------------------------------

async def test_a_decode_abort_in_prefills_bootstrap_queue_polls_only_what_that_queue_takes(sglang_ranks,
                                                                                           engine_brokers):
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(33)

    def run():
        sender, receiver = start(pair, request)  # the sender is WaitingForInput: pop_bootstrapped polls it
        with paused(prefill_broker):
            receiver.side.abort()
            until(lambda: pair.prefill.room(request.room).request.cancelled, "decode's abort frame never came")
            for _ in range(3):
                sender.poll()  # the cancel has not answered: the broker is paused
            assert_accepted(sender, "prefill bootstrap")
        assert sender.until(_poll("Failed")) == _poll("Failed")
        return sender

    sender = await asyncio.to_thread(run)
    assert_accepted(sender, "prefill bootstrap")
    error = failure(sender)
    assert error.code is grpc.StatusCode.CANCELLED and error.failure_reason.startswith("kvbroker CANCELLED: ")


# -- every phase -----------------------------------------------------------------------------------------

async def test_every_phase_polls_only_what_its_queues_take_through_aborts_on_either_side(sglang_ranks, broker_pair):
    prefill_broker, decode_broker = broker_pair
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)

    def prefill_abort_in_bootstrap():
        sender, receiver = start(pair, new_request(41))
        with paused(prefill_broker):
            sender.side.abort()
            sender.poll()
        sender.until(_poll("Failed")), receiver.until(_poll("Failed"))
        assert_accepted(sender, "prefill bootstrap")

    def decode_abort_in_inflight():
        request = new_request(42)
        sender, receiver = start(pair, request)
        assert_accepted(sender, "prefill bootstrap")
        sender.seen.clear()
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        sender.until(_poll("Transferring"))
        with paused(prefill_broker):
            receiver.side.abort()
            until(lambda: pair.prefill.room(request.room).request.cancelled, "decode's abort frame never came")
            assert sender.poll() == _poll("Transferring")  # a part may still read its pages: held
        sender.until(_poll("Failed"))
        assert_accepted(sender, "prefill inflight")

    def decode_abort_in_prealloc():
        receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, new_request(43).room))
        receiver.poll()
        receiver.side.init(0)
        receiver.until(_poll("WaitingForInput"))
        with paused(decode_broker):
            receiver.side.abort()
            receiver.poll()
        receiver.until(_poll("Failed"))
        assert_accepted(receiver, "decode prealloc")

    def decode_abort_in_transfer():
        request = new_request(44)
        sender, receiver = start(pair, request)
        assert_accepted(receiver, "decode prealloc")  # before send_metadata: WaitingForInput at most
        receiver.seen.clear()
        with paused(decode_broker):
            receiver.side.abort()
            assert receiver.poll() == _poll("Transferring")  # the grant may still be written: held
        receiver.until(_poll("Failed")), sender.until(_poll("Failed"))
        assert_accepted(receiver, "decode transfer")
        assert_accepted(sender, "prefill bootstrap")

    for case in (prefill_abort_in_bootstrap, decode_abort_in_inflight, decode_abort_in_prealloc,
                 decode_abort_in_transfer):
        await asyncio.to_thread(case)


# -- what prefill reports of a request -------------------------------------------------------------------

async def test_the_transfer_metric_is_the_brokers_bytes_and_the_time_to_its_success(sglang_ranks, engine_brokers):
    prefill_broker, decode_broker = engine_brokers
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(51)

    def run():
        sender, receiver = start(pair, request)
        began = time.perf_counter()
        _finish(pair, sender, receiver, request)
        ended = time.perf_counter()
        sender.side.clear()  # prefill.py clears the sender before it reads the metric
        return sender.side.get_transfer_metric(), ended - began

    metric, bound = await asyncio.to_thread(run)
    kv_args = pair.prefill_rank.kv_args
    index_items, dense_items = (sum(lens) for lens in kv_args.state_item_lens)
    moved = PAGES - PREFIX_PAGES
    # the main KV and the index K of the 8 pages after decode's prefix, the dense KV of all 10
    assert metric.transfer_total_bytes == moved * sum(kv_args.kv_item_lens) + moved * index_items + PAGES * dense_items
    assert metric.transfer_total_bytes != moved * pair.prefill.kv_item_lens_sum + (moved + PAGES) * \
        pair.prefill.state_item_lens_sum  # SGLang's estimate counts every state page at every state's size
    assert metric.transfer_latency_s is not None and 0 < metric.transfer_latency_s <= bound
