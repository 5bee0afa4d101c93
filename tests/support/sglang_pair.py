"""One chunked request between a prefill and a decode SGLang rank on two real brokers, driven as
SGLang's schedulers drive it (test_end_to_end.py, test_orders.py):

- the request: `new_request` (10 pages, decode holding a 2-page prefix, `CHUNKS` the 3 chunks of the
  other 8) and the ranks' managers `make_pair` makes;
- the schedulers' steps: `start` (both bootstrap queues, decode's metadata sent), `send_chunk`
  (SGLang's send_kv_chunk, the last chunk with the states and the aux row), `released` (decode's
  deferred release of a failed request), each SGLang side polled as `Watched`;
- what decode must hold: `snapshot`, `expected_decode`, `assert_decode_bytes`; `failure`, the
  error a failed side reports.
Not a test module: test modules import from here, never from each other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender, KvbrokerTransferError
from tests.support import sglang_ranks as ranks

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
    receiver.until(*polls("WaitingForInput"))
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
    (waiting,), (failed,) = polls("WaitingForInput"), polls("Failed")
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


def polls(*names):
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


THROUGH = ("Bootstrapping", "WaitingForInput", "Transferring")  # prefill's polls before its end
RECEIVING = ("Bootstrapping", "WaitingForInput")  # decode's: as with SGLang's mooncake, no Transferring per chunk


def decode_saw(receiver: Watched, end: str) -> bool:
    """decode's polls were Bootstrapping, WaitingForInput, then `end`; before a Failed, Transferring
    too while its cancel was unanswered (holding: the grant may still be written)."""
    paths = [polls(*RECEIVING, end)] + ([polls(*RECEIVING, "Transferring", end)] if end == "Failed" else [])
    return receiver.seen in paths


def first_chunk_lands(sender: Watched, receiver: Watched) -> None:
    """The first part's reply (Transferring on prefill) comes once decode's broker took its notice:
    the chunk landed there (decode's receiver says nothing of it: WaitingForInput until the end)."""
    sender.until(*polls("Transferring"))
    receiver.poll()
