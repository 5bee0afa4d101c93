"""A prefill and a decode SGLang rank on two real brokers, driven as SGLang's schedulers drive them.

Both ranks hold a real MiniMaxSparseKVPool (CPU, /dev/shm) described by SGLang's own
setup_state_kv_args; discovery runs through SGLang's bootstrap server; the request is 10 pages,
decode already holds a 2-page prefix, and prefill sends the other 8 in 3 chunks (the last with the
index-K suffix, the dense KV of all 10 pages and the aux row). Then every byte of every component
and of the aux row is checked on decode, with the bytes around them, and the KVPoll each side saw.

These tests need the offered flow of issue 13 (ExpectTransfer naming the sender, Transfer parts, aux):
until BrokerClient has `transfer_part` they are expected to fail, and strictly so, so that they turn
into plain tests the moment the flow is merged.
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
from kvbroker_client import BrokerClient
from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender, KvbrokerTransferError
from tests.sglang import ranks
from tests.sglang.conftest import BROKER_FLAGS

FLOW = hasattr(BrokerClient, "transfer_part")
pytestmark = [pytest.mark.integration,
              pytest.mark.xfail(not FLOW, strict=True, reason="needs the offered flow (issue 13)")]

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


def start(pair: Pair, request: Request) -> tuple[Watched, Watched]:
    """Both bootstrap queues: a sender and a receiver; decode allocates and sends its metadata."""
    from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages

    sender = Watched(KvbrokerKVSender(pair.prefill, pair.bootstrap, request.room))
    receiver = Watched(KvbrokerKVReceiver(pair.decode, pair.bootstrap, request.room))
    sender.poll(), receiver.poll()
    receiver.side.init(0)
    receiver.until(*_polls("WaitingForInput"))
    decode_tokens = request.token_indices(request.decode_pages)
    prefix = PREFIX_PAGES * ranks.PAGE_SIZE
    index_pages = minimax_index_transfer_pages(decode_tokens, page_size=ranks.PAGE_SIZE, prefix_len=prefix)
    receiver.side.send_metadata(request.decode_pages[PREFIX_PAGES:].astype(np.int32), DECODE_AUX,
                                [index_pages, request.decode_pages.astype(np.int32)], decode_prefix_len=prefix)
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


async def test_a_chunked_request_lands_every_byte_and_the_aux_row(sglang_ranks, broker_pair):
    prefill_broker, decode_broker = broker_pair
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(1)
    before = snapshot(pair)

    def run():
        sender, receiver = start(pair, request)
        assert sender.side.pop_decode_prefix_len() == PREFIX_PAGES * ranks.PAGE_SIZE
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        for i in range(len(CHUNKS)):
            send_chunk(pair, sender, request, i)
        return sender.until(*_polls("Success", "Failed")), receiver.until(*_polls("Success", "Failed")), \
            sender, receiver

    sent, received, sender, receiver = await asyncio.to_thread(run)
    assert (sent, received) == tuple(_polls("Success", "Success")), (sender.seen, receiver.seen)
    assert sender.seen[:2] == _polls("Bootstrapping", "WaitingForInput") and sender.seen[-1] == sent
    assert receiver.seen[:2] == _polls("Bootstrapping", "WaitingForInput") and receiver.seen[-1] == received
    assert sender.seen == sorted(sender.seen) and receiver.seen == sorted(receiver.seen)
    assert_decode_bytes(pair, expected_decode(pair, request, before, len(CHUNKS)))
    got = pair.decode_rank.metadata.get_buf(DECODE_AUX)
    for mine, theirs in zip(got, pair.prefill_rank.metadata.get_buf(PREFILL_AUX)):
        if theirs is not None:
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert int(pair.decode_rank.metadata.bootstrap_room[DECODE_AUX, 0]) == request.room  # decode's room check
    sender.side.clear(), receiver.side.clear()


async def test_a_prefill_abort_mid_request_fails_both_sides_with_the_brokers_reason(sglang_ranks, broker_pair):
    prefill_broker, decode_broker = broker_pair
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(2)
    before = snapshot(pair)

    def run():
        sender, receiver = start(pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        receiver.until(*_polls("Transferring"))
        sender.side.abort()
        send_chunk(pair, sender, request, 1)  # the scheduler may still call it: nothing moves
        return sender.until(*_polls("Failed")), receiver.until(*_polls("Failed")), sender, receiver

    _, _, sender, receiver = await asyncio.to_thread(run)
    assert "Aborted by AbortReq" in failure(sender).failure_reason
    error = failure(receiver)
    assert error.code is grpc.StatusCode.CANCELLED and "Aborted by AbortReq" in error.failure_reason
    assert_decode_bytes(pair, expected_decode(pair, request, before, 1))


async def test_a_decode_abort_mid_request_fails_both_sides_and_nothing_lands_after(sglang_ranks, broker_pair):
    prefill_broker, decode_broker = broker_pair
    pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
    request = new_request(3)
    before = snapshot(pair)

    def run():
        sender, receiver = start(pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        send_chunk(pair, sender, request, 0)
        receiver.until(*_polls("Transferring"))
        receiver.side.abort()
        receiver.until(*_polls("Failed"))  # only once the broker's cancel answered: no write runs
        send_chunk(pair, sender, request, 1)
        send_chunk(pair, sender, request, 2)
        return sender.until(*_polls("Failed")), sender, receiver

    _, sender, receiver = await asyncio.to_thread(run)
    assert "Aborted by AbortReq" in failure(receiver).failure_reason
    error = failure(sender)
    assert error.code is not None and error.failure_reason.startswith("kvbroker ")
    assert_decode_bytes(pair, expected_decode(pair, request, before, 1))


async def test_a_decode_broker_restart_mid_request_fails_both_sides_with_the_brokers_reason(sglang_ranks):
    prefill_broker = await start_broker("sglang-restart-prefill", *BROKER_FLAGS)
    decode_broker = await start_broker("sglang-restart-decode", *BROKER_FLAGS)
    try:
        pair = await make_pair(sglang_ranks, prefill_broker.listen, decode_broker.listen)
        request = new_request(4)
        sender, receiver = await asyncio.to_thread(start, pair, request)
        sender.side.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
        await asyncio.to_thread(send_chunk, pair, sender, request, 0)
        await decode_broker.stop()
        decode_broker = await start_broker("sglang-restart-decode", *BROKER_FLAGS, "--listen", decode_broker.listen,
                                           "--peer-listen", decode_broker.peer_listen)
        assert await asyncio.to_thread(receiver.until, *_polls("Failed")) == _polls("Failed")[0]
        error = failure(receiver)
        assert error.code is not None and error.failure_reason.startswith("kvbroker ")
        await asyncio.to_thread(send_chunk, pair, sender, request, 1)
        await asyncio.to_thread(send_chunk, pair, sender, request, 2)
        assert await asyncio.to_thread(sender.until, *_polls("Failed")) == _polls("Failed")[0]
        assert failure(sender).failure_reason.startswith("kvbroker ")
    finally:
        await asyncio.gather(prefill_broker.stop(), decode_broker.stop())
