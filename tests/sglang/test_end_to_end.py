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
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import torch

from kvbroker.tools.launch import start_broker
from kvbroker_client import BrokerClient, Component
from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender, KvbrokerTransferError
from tests.sglang import ranks
from tests.sglang.conftest import broker_flags

pytestmark = pytest.mark.integration

PAGES, PREFIX_PAGES = 10, 2
CHUNKS = [slice(2, 5), slice(5, 8), slice(8, 10)]  # the 8 pages after decode's prefix, in 3 chunks
PREFILL_AUX, DECODE_AUX = 5, 2
POLL_TIMEOUT_S = 60.0


@dataclass
class Watched:
    """An SGLang sender or receiver, polled as the scheduler polls it; the distinct KVPolls it showed."""

    side: object
    seen: list = field(default_factory=list)

    def poll(self):
        value = self.side.poll()
        if not self.seen or self.seen[-1] != value:
            self.seen.append(value)
        return value

    def until(self, *targets, timeout: float = POLL_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while (value := self.poll()) not in targets:
            assert time.monotonic() < deadline, f"{type(self.side).__name__} stuck in {value} (saw {self.seen})"
            time.sleep(0.002)  # the scheduler's next loop iteration
        return value


@dataclass
class Request:
    room: int
    prefill_pages: np.ndarray  # the request's 10 pages in prefill's pool
    decode_pages: np.ndarray  # the same 10 pages in decode's pool; the first 2 are its cached prefix

    def token_indices(self, pages: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((pages[:, None] * ranks.PAGE_SIZE + np.arange(ranks.PAGE_SIZE)).reshape(-1))


_rooms = iter(range(7_000_001, 1 << 40))


def new_request(seed: int) -> Request:
    rng = np.random.default_rng(seed)
    num_pages = (ranks.POOL_TOKENS + ranks.PAGE_SIZE) // ranks.PAGE_SIZE
    return Request(next(_rooms), rng.choice(np.arange(1, num_pages), PAGES, replace=False),
                   rng.choice(np.arange(1, num_pages), PAGES, replace=False))


@dataclass
class Pair:
    prefill: object  # KvbrokerKVManager
    decode: object
    prefill_rank: ranks.Rank
    decode_rank: ranks.Rank
    bootstrap: str


async def make_pair(sglang_ranks, prefill_listen: str, decode_listen: str, **env) -> Pair:
    await asyncio.to_thread(sglang_ranks.bootstrap_server)
    prefill_rank = ranks.rank_kv_args(ranks.minimax_pool(11))
    decode_rank = ranks.rank_kv_args(ranks.minimax_pool(12, fill="canary"))
    prefill = await asyncio.to_thread(sglang_ranks.manager, prefill_listen, "prefill", prefill_rank, **env)
    decode = await asyncio.to_thread(sglang_ranks.manager, decode_listen, "decode", decode_rank, **env)
    bootstrap = f"127.0.0.1:{sglang_ranks.process.bootstrap_port}"
    assert await asyncio.to_thread(decode.try_ensure_parallel_info, bootstrap)
    return Pair(prefill, decode, prefill_rank, decode_rank, bootstrap)


def fill_prefill_aux(pair: Pair, room: int) -> None:
    metadata = pair.prefill_rank.metadata
    generator = torch.Generator().manual_seed(room % 1000)
    metadata.output_ids[PREFILL_AUX] = torch.randint(0, 1 << 20, (16,), generator=generator, dtype=torch.int32)
    metadata.cached_tokens[PREFILL_AUX, 0] = PREFIX_PAGES * ranks.PAGE_SIZE
    metadata.output_hidden_states[PREFILL_AUX] = torch.randn(ranks.HIDDEN_SIZE, generator=generator).to(torch.bfloat16)
    metadata.bootstrap_room[PREFILL_AUX, 0] = room


def send_decode_metadata(pair: Pair, request: Request, receiver: Watched) -> None:
    """decode.py's prealloc queue: the receiver bootstraps, decode allocates and sends its metadata."""
    from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages

    receiver.side.init(0)
    receiver.until(*_polls("WaitingForInput"))
    decode_tokens = request.token_indices(request.decode_pages)
    prefix = PREFIX_PAGES * ranks.PAGE_SIZE
    index_pages = minimax_index_transfer_pages(decode_tokens, page_size=ranks.PAGE_SIZE, prefix_len=prefix)
    receiver.side.send_metadata(request.decode_pages[PREFIX_PAGES:].astype(np.int32), DECODE_AUX,
                                [index_pages, request.decode_pages.astype(np.int32)], decode_prefix_len=prefix)


def start(pair: Pair, request: Request) -> tuple[Watched, Watched]:
    """Both bootstrap queues: a sender and a receiver; decode allocates and sends its metadata."""
    sender = Watched(KvbrokerKVSender(pair.prefill, pair.bootstrap, request.room))
    receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, request.room))
    sender.poll(), receiver.poll()
    send_decode_metadata(pair, request, receiver)
    (waiting,), (failed,) = _polls("WaitingForInput"), _polls("Failed")
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while sender.poll() != waiting:
        if receiver.poll() == failed:
            raise AssertionError(f"decode failed before prefill saw its offer: {failure(receiver)}")
        assert time.monotonic() < deadline, f"the prefill sender never saw decode's offer (saw {sender.seen})"
        time.sleep(0.002)  # the scheduler's next loop iteration
    return sender, receiver


def send_chunk(pair: Pair, sender: Watched, request: Request, i: int) -> None:
    """SGLang's send_kv_chunk: the chunk's pages; the last also its states (and the aux row is set)."""
    from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages

    pages = request.prefill_pages[CHUNKS[i]].astype(np.int32)
    if i < len(CHUNKS) - 1:
        sender.side.send(pages)
        return
    fill_prefill_aux(pair, request.room)
    tokens = request.token_indices(request.prefill_pages)
    index = minimax_index_transfer_pages(tokens, page_size=ranks.PAGE_SIZE,
                                         prefix_len=PREFIX_PAGES * ranks.PAGE_SIZE)
    sender.side.send(pages, [index, request.prefill_pages.astype(np.int32)])


def _polls(*names):
    from sglang.srt.disaggregation.base.conn import KVPoll

    return [getattr(KVPoll, n) for n in names]


def expected_decode(pair: Pair, request: Request, before: dict, landed_chunks: int) -> dict:
    """Every decode buffer as it must be: canary except the pages moved (the prefix stays as it was)."""
    out = {name: [b.copy() for b in bufs] for name, bufs in before.items()}
    moved = [p for c in CHUNKS[:landed_chunks] for p in range(c.start, c.stop)]
    whole = {"MAIN_KV": moved}
    if landed_chunks == len(CHUNKS):
        whole["MINIMAX_INDEX_K"] = moved
        whole["MINIMAX_DENSE_KV"] = list(range(PAGES))
    for name, positions in whole.items():
        src = ranks.page_bytes(pair.prefill_rank.pool, name, request.prefill_pages[positions])
        for buffer, rows in zip(out[name], src):
            view = buffer.reshape(-1, rows.shape[1])
            view[request.decode_pages[positions]] = rows
    return out


def assert_decode_bytes(pair: Pair, expected: dict) -> None:
    for name, buffers in expected.items():
        for i, (got, want) in enumerate(zip(ranks.whole(pair.decode_rank.pool, name), buffers)):
            diff = np.flatnonzero(got != want)
            assert diff.size == 0, f"{name} buffer {i}: {diff.size} bytes differ, first at {diff[0]}"


def snapshot(pair: Pair) -> dict:
    return {name: ranks.whole(pair.decode_rank.pool, name) for name in ("MAIN_KV", "MINIMAX_INDEX_K",
                                                                        "MINIMAX_DENSE_KV")}


def failure(watched: Watched) -> KvbrokerTransferError:
    with pytest.raises(KvbrokerTransferError) as raised:
        watched.side.failure_exception()
    return raised.value


def released(pair: Pair, receiver: Watched, timeout: float = POLL_TIMEOUT_S) -> None:
    """decode.py's path for a failed request: notify prefill (armed), then hold the pages until every
    prefill rank acked; kvbroker's ack is its broker's answer to the cancel (no write runs)."""
    assert pair.decode.enable_deferred_decode_kv_release
    receiver.side.ensure_abort_notified(force_arm=True)
    required = len(receiver.side.bootstrap_infos)
    deadline = time.monotonic() + timeout
    while not pair.decode.is_abort_release_safe(receiver.side.bootstrap_room, required):
        assert time.monotonic() < deadline, "decode's deferred release was never acked"
        time.sleep(0.002)  # the scheduler's next loop iteration


THROUGH = ("Bootstrapping", "WaitingForInput", "Transferring")


def first_chunk_lands(sender: Watched, receiver: Watched) -> None:
    receiver.until(*_polls("Transferring"))
    sender.until(*_polls("Transferring"))


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
        return sender.until(*_polls("Success", "Failed")), receiver.until(*_polls("Success", "Failed")), \
            sender, receiver

    sent, received, sender, receiver = await asyncio.to_thread(run)
    assert (sent, received) == tuple(_polls("Success", "Success")), (sender.seen, receiver.seen)
    assert sender.seen == _polls(*THROUGH, "Success") and receiver.seen == _polls(*THROUGH, "Success")
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
        receiver.until(*_polls("WaitingForInput"))
        index = minimax_index_transfer_pages(request.token_indices(request.decode_pages), page_size=ranks.PAGE_SIZE,
                                             prefix_len=prefix)
        assert len(index) == 0
        receiver.side.send_metadata(np.array([], dtype=np.int32), DECODE_AUX,
                                    [index, request.decode_pages.astype(np.int32)], decode_prefix_len=prefix)
        sender.until(*_polls("WaitingForInput"))
        sender.side.init(0, PREFILL_AUX)
        fill_prefill_aux(pair, request.room)
        assert sender.side.should_send_kv_chunk(0, last_chunk=True)
        sender.side.send(np.array([], dtype=np.int32), [index, request.prefill_pages.astype(np.int32)])
        return sender.until(*_polls("Success", "Failed")), receiver.until(*_polls("Success", "Failed")), receiver

    sent, received, receiver = await asyncio.to_thread(run)
    assert (sent, received) == tuple(_polls("Success", "Success"))
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
        return sender.until(*_polls("Failed")), receiver.until(*_polls("Failed")), sender, receiver

    _, _, sender, receiver = await asyncio.to_thread(run)
    assert sender.seen == _polls(*THROUGH, "Failed") and receiver.seen == _polls(*THROUGH, "Failed")
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
        receiver.until(*_polls("Failed"))  # only once the broker's cancel answered: no write runs
        send_chunk(pair, sender, request, 1)
        send_chunk(pair, sender, request, 2)
        return sender.until(*_polls("Failed")), sender, receiver

    _, sender, receiver = await asyncio.to_thread(run)
    assert sender.seen == _polls(*THROUGH, "Failed") and receiver.seen == _polls(*THROUGH, "Failed")
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
        state = pair.decode._rooms[request.room]
        receiver.side.clear()
        state.cancel.result(timeout=POLL_TIMEOUT_S)  # the broker answered: no write into the grant runs
        send_chunk(pair, sender, request, 1)
        send_chunk(pair, sender, request, 2)
        return sender.until(*_polls("Failed")), sender

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
        assert await asyncio.to_thread(receiver.until, *_polls("Failed")) == _polls("Failed")[0]
        error = failure(receiver)
        assert error.code is grpc.StatusCode.UNAVAILABLE and error.failure_reason.startswith("kvbroker UNAVAILABLE: ")
        await asyncio.to_thread(released, pair, receiver)
        await asyncio.to_thread(send_chunk, pair, sender, request, 1)
        await asyncio.to_thread(send_chunk, pair, sender, request, 2)
        assert await asyncio.to_thread(sender.until, *_polls("Failed")) == _polls("Failed")[0]
        assert sender.seen == _polls(*THROUGH, "Failed") and receiver.seen == _polls(*THROUGH, "Failed")
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
        assert await asyncio.to_thread(sender.until, *_polls("Failed")) == _polls("Failed")[0]
        mine = failure(sender)
        assert mine.code is grpc.StatusCode.UNAVAILABLE and mine.failure_reason.startswith("kvbroker UNAVAILABLE: ")
        await asyncio.to_thread(send_chunk, pair, sender, request, 1)
        assert await asyncio.to_thread(receiver.until, *_polls("Failed")) == _polls("Failed")[0]
        assert sender.seen == _polls(*THROUGH, "Failed") and receiver.seen == _polls(*THROUGH, "Failed")
        error = failure(receiver)
        assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.failure_reason.startswith("kvbroker DEADLINE_EXCEEDED: ")
        await asyncio.to_thread(released, pair, receiver)
        assert_decode_bytes(pair, expected_decode(pair, request, before, 1))
    finally:
        await asyncio.gather(prefill_broker.stop(), decode_broker.stop())
