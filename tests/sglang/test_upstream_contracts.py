"""SGLang 0.5.23's own CPU contracts for a transfer backend, held by kvbroker's classes.

Adapted from the upstream tests of `test/registered/unit/disaggregation/` that apply to any backend
(see clients/README.md for which ran, which were adapted and why the others cannot):
test_common_sender_lifecycle.py (abort, bootstrap timeout, a missing room), test_fake_kv_sender.py
(the zero-page last chunk, stable polls), test_disaggregation_wire.py (frames round-trip, foreign
frames refused), and discovery through SGLang's bootstrap server as decode.py drives it. The chunk
and state contracts of the sender lifecycle test (two chunks, the zero-KV final chunk) and the
deferred decode KV release run end to end on real brokers: test_end_to_end.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import requests

from kvbroker_sglang.conn import KvbrokerTransferError
from kvbroker_sglang.wire import Metadata, Registration, WireError
from tests.support import sglang_ranks as ranks

pytestmark = pytest.mark.integration
ROOM = 424242


@pytest.fixture
def kvpoll(sglang_process):
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll


async def _prefill(sglang_ranks, broker, seed=3):
    await asyncio.to_thread(sglang_ranks.bootstrap_server)
    rank = ranks.rank_kv_args(ranks.minimax_pool(seed))
    return await asyncio.to_thread(sglang_ranks.manager, broker.listen, "prefill", rank)


def _sender(manager, room=ROOM):
    from kvbroker_sglang.conn import KvbrokerKVSender

    return KvbrokerKVSender(manager, f"127.0.0.1:{manager.bootstrap_port}", room)


def _settle(manager, room):
    """Wait (bounded) for the room's cancel on the broker, if one was started."""
    request = manager.request_of(room)
    if request is not None:
        request.wait_quiesced(30)


async def test_a_zero_page_last_chunk_is_still_sent_and_other_empty_chunks_are_not(sglang_ranks, broker_pair):
    sender = _sender(await _prefill(sglang_ranks, broker_pair[0]))
    assert sender.should_send_kv_chunk(0, last_chunk=True)
    assert not sender.should_send_kv_chunk(0, last_chunk=False)
    assert sender.should_send_kv_chunk(3, last_chunk=False)


async def test_polls_before_decode_arrives_stay_bootstrapping(sglang_ranks, broker_pair, kvpoll):
    sender = _sender(await _prefill(sglang_ranks, broker_pair[0]))
    sender.init(3, 5)
    assert {sender.poll() for _ in range(1000)} == {kvpoll.Bootstrapping}
    assert sender.conclude_state is None


async def test_abort_fails_the_sender_with_sglangs_reason_and_enqueues_nothing(sglang_ranks, broker_pair, kvpoll):
    import numpy as np

    manager = await _prefill(sglang_ranks, broker_pair[0])
    sender = _sender(manager)
    sender.init(1, aux_index=0)
    sender.abort()
    await asyncio.to_thread(_settle, manager, ROOM)
    sender.send(np.array([1], dtype=np.int32))
    assert not [t for t in manager.link.loop._tasks if t.get_name().startswith("part")]
    assert sender.poll() == kvpoll.Failed
    with pytest.raises(KvbrokerTransferError, match="Aborted by AbortReq"):
        sender.failure_exception()
    assert sender.poll() == kvpoll.Failed


async def test_the_bootstrap_timeout_latches_failed_and_cleans_up(sglang_ranks, broker_pair, kvpoll):
    manager = await _prefill(sglang_ranks, broker_pair[0])
    sender = _sender(manager)
    sender.init_time = time.time() - manager.bootstrap_timeout - 1
    assert sender.poll() == kvpoll.Failed
    assert "timed out" in manager.failure_records[ROOM]
    with pytest.raises(KvbrokerTransferError) as raised:
        sender.failure_exception()
    assert not raised.value.is_from_another_rank
    assert ROOM not in manager.failure_records and ROOM not in manager.request_status
    assert sender.poll() == kvpoll.Failed


async def test_a_missing_room_is_failed_without_resurrecting_it(sglang_ranks, broker_pair, kvpoll):
    manager = await _prefill(sglang_ranks, broker_pair[0])
    sender = _sender(manager)
    del manager.request_status[ROOM]
    assert sender.poll() == kvpoll.Failed
    assert ROOM not in manager.request_status
    with pytest.raises(KvbrokerTransferError) as raised:
        sender.failure_exception()
    assert raised.value.is_from_another_rank


def test_frames_round_trip_and_foreign_frames_are_refused():
    registration = Registration("127.0.0.1:5000", "127.0.0.1:50062", "decode-0/tp0", 1, 0, (64, 64, 8))
    assert Registration.from_frames(registration.to_frames()) == registration
    metadata = Metadata(2**62 + 5, "127.0.0.1:5000", "decode-0/tp0", 1, 8, False, "decode-broker-0")
    assert Metadata.from_frames(metadata.to_frames()) == metadata
    older = json.loads(metadata.to_frames()[2])
    del older["broker_id"]  # a decode of the version before names no broker: prefill's parts name none
    assert Metadata.from_frames([*metadata.to_frames()[:2], json.dumps(older).encode()]).broker_id == ""
    with pytest.raises(WireError, match="expected"):
        Metadata.from_frames(registration.to_frames())
    with pytest.raises(WireError, match="version"):
        Metadata.from_frames([metadata.to_frames()[0], b"99", metadata.to_frames()[2]])
    with pytest.raises(WireError, match="expected"):
        Registration.from_frames([b"None", b"127.0.0.1", b"1234"])  # Mooncake's registration frame


async def test_route_names_each_prefill_ranks_broker_and_decode_discovers_it(sglang_ranks, broker_pair, kvpoll):
    prefill_broker, decode_broker = broker_pair
    prefill = await _prefill(sglang_ranks, prefill_broker)
    bootstrap = f"127.0.0.1:{prefill.bootstrap_port}"
    row = (await asyncio.to_thread(requests.get, f"http://{bootstrap}/route?prefill_dp_rank=0&prefill_cp_rank=0&"
                                   "target_tp_rank=0&target_pp_rank=0", timeout=10)).json()
    assert row["kvbroker_address"] == prefill_broker.peer_listen
    assert row["kvbroker_engine_id"] == prefill.engine_id
    assert row["rank_port"] == prefill.rank_port

    from kvbroker_sglang.conn import KvbrokerKVReceiver

    decode_rank = ranks.rank_kv_args(ranks.minimax_pool(4, fill="canary"))
    decode = await asyncio.to_thread(sglang_ranks.manager, decode_broker.listen, "decode", decode_rank)
    assert await asyncio.to_thread(decode.try_ensure_parallel_info, bootstrap)
    receiver = KvbrokerKVReceiver(decode, bootstrap, ROOM)
    assert receiver.poll() == kvpoll.Bootstrapping
    await asyncio.to_thread(receiver.init, 0)
    assert receiver.poll() == kvpoll.WaitingForInput

    def registered() -> bool:
        with prefill.peers_changed:
            return prefill.peers_changed.wait_for(
                lambda: decode.engine_id in {r.engine_id for r in prefill.decode_kv_args_table.values()}, timeout=30)

    assert await asyncio.to_thread(registered), "the registration frame never reached the prefill rank"
    (registration,) = prefill.decode_kv_args_table.values()
    assert registration.broker_address == decode_broker.peer_listen
