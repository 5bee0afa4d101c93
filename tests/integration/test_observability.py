"""What an operator sees of real brokers: the /metrics endpoint, one JSON log line per request end,
and `kvbroker status`. Counters are compared before and after each test, so the tests share a pair."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import SMALL, BrokerPair, close_broker, open_broker
from tests.support.flows import grant, log_entries, transfer
from tests.support.helpers import kvbroker

pytestmark = pytest.mark.integration

NAMES = {pb.COMPONENT_MAIN_KV: "MAIN_KV", pb.COMPONENT_MINIMAX_INDEX_K: "MINIMAX_INDEX_K"}


@pytest.fixture(scope="module")
async def observed() -> BrokerPair:
    """nixl brokers at INFO with metrics; the prefill logs JSON by flag, the decode by default (a pipe)."""
    common = ("--log-level", "INFO", "--metrics-listen", "127.0.0.1:0")
    prefill = await open_broker("obs-prefill", "nixl", *common, "--log-format", "json")
    decode = await open_broker("obs-decode", "nixl", *common)
    yield BrokerPair("nixl", prefill, decode)
    for broker in (prefill, decode):
        await close_broker(broker)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


async def scrape(broker) -> dict[tuple, float]:
    """Every sample of the broker's /metrics, keyed by (name, sorted labels)."""
    text = await asyncio.to_thread(_get, f"http://{broker.process.metrics_listen}/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def component_bytes(engine, component: int, pages: int) -> int:
    return pages * sum(p.item_len for p in engine.placements if p.component == component)


async def log_lines(broker, request_id: str, count: int = 1, timeout: float = 10.0) -> list[dict]:
    """The broker's JSON log lines about `request_id`, once `count` of them have arrived."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = [entry for entry in log_entries(broker) if entry.get("request_id") == request_id]
        if len(found) >= count or loop.time() > deadline:
            return found
        await asyncio.sleep(0.05)


async def moved(pair: BrokerPair, engines, request_id: str):
    """One MAIN_KV + MINIMAX_INDEX_K transfer of 8 pages in 2 runs; returns (src, dst, reply status)."""
    src = await engines.make(pair.prefill, "prefill")
    dst = await engines.make(pair.decode, "decode", fill="canary")
    await grant(dst, request_id, [10, 11, 12, 13, 20, 21, 22, 23])
    reply = await transfer(src, dst, request_id, [0, 1, 2, 3, 4, 5, 6, 7])
    return src, dst, reply.status


# -- metrics ------------------------------------------------------------------------------------

async def test_metrics_count_a_transfer_on_both_sides(observed, engines, request_id):
    before = [await scrape(observed.prefill), await scrape(observed.decode)]
    src, dst, status = await moved(observed, engines, request_id)
    after = [await scrape(observed.prefill), await scrape(observed.decode)]
    assert (status.pages, status.runs, status.bytes) == (8, 2, SMALL.request_bytes(8))

    for b, a, role, engine in zip(before, after, ("sender", "receiver"), (src, dst)):
        for component, name in NAMES.items():
            labels = dict(role=role, component=name)
            assert delta(b, a, "kvbroker_transfers_started_total", **labels) == 1
            assert delta(b, a, "kvbroker_transfers_succeeded_total", **labels) == 1
            assert delta(b, a, "kvbroker_transferred_bytes_total", **labels) == component_bytes(engine, component, 8)
        assert sum(delta(b, a, "kvbroker_transferred_bytes_total", role=role, component=n)
                   for n in NAMES.values()) == status.bytes
        assert delta(b, a, "kvbroker_transferred_pages_total", role=role) == 8
        assert delta(b, a, "kvbroker_transferred_runs_total", role=role) == 2
        assert delta(b, a, "kvbroker_transfer_duration_seconds_count", role=role, outcome="succeeded") == 1
        assert delta(b, a, "kvbroker_transfer_queue_wait_seconds_count", role=role) == 1
        assert delta(b, a, "kvbroker_engines") == 1
        assert delta(b, a, "kvbroker_registered_bytes", component="MINIMAX_INDEX_K") == component_bytes(
            engine, pb.COMPONENT_MINIMAX_INDEX_K, SMALL.num_pages)
    assert delta(before[0], after[0], "kvbroker_peer_handshakes_total") == 1
    assert delta(before[0], after[0], "kvbroker_peer_epoch_changes_total") == 0


async def test_metrics_count_each_part_notice_and_the_notify_call_that_carried_it(observed, engines, request_id):
    """...and the offer the decode broker sent, as a message of its NotifyStream to the prefill broker."""
    src = await engines.make(observed.prefill, "prefill")
    dst = await engines.make(observed.decode, "decode", fill="canary")
    before, offers_before = await scrape(observed.prefill), await scrape(observed.decode)
    await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, expiry_ms=30_000,
        pages=[pb.ComponentPages(component=pb.COMPONENT_MAIN_KV, page_ids=[10, 11, 12, 13])],
        sender_address=observed.prefill.peer_address, sender_engine_id=src.engine_id), timeout=10)
    for offset, last in ((0, False), (2, True)):
        await src.stub.Transfer(bpb.TransferRequest(
            request_id=request_id, engine_id=src.engine_id, more_parts=not last,
            pages=[bpb.PartPages(component=pb.COMPONENT_MAIN_KV, src_page_ids=[offset, offset + 1],
                                 dst_offset=offset)]), timeout=30)
    after = await scrape(observed.prefill)
    assert delta(before, after, "kvbroker_peer_part_notices_total") == 2  # one per part, sent in turn
    assert delta(before, after, "kvbroker_peer_notify_calls_total") == 2
    assert delta(before, after, "kvbroker_peer_notify_streamed_total") == 2  # as messages of one NotifyStream
    offers_after = await scrape(observed.decode)
    assert delta(offers_before, offers_after, "kvbroker_peer_offers_total") == 1
    assert delta(offers_before, offers_after, "kvbroker_peer_offers_streamed_total") == 1


async def test_metrics_count_the_grpc_messages_of_a_request_per_port_method_and_direction(observed, engines,
                                                                                        request_id):
    """An offered request of one part through the unary calls: each call's request and reply on the
    local ports, and its peer messages: the offer on the prefill broker's peer port, the part's notice
    on the decode broker's, each a NotifyStream message and its answer."""
    src = await engines.make(observed.prefill, "prefill")
    dst = await engines.make(observed.decode, "decode", fill="canary")

    async def offered(rid: str, dst_pages: list[int], src_pages: list[int]) -> None:
        await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
            request_id=rid, engine_id=dst.engine_id, expiry_ms=30_000,
            pages=[pb.ComponentPages(component=pb.COMPONENT_MAIN_KV, page_ids=dst_pages)],
            sender_address=observed.prefill.peer_address, sender_engine_id=src.engine_id), timeout=10)
        await src.stub.Transfer(bpb.TransferRequest(
            request_id=rid, engine_id=src.engine_id,
            pages=[bpb.PartPages(component=pb.COMPONENT_MAIN_KV, src_page_ids=src_pages)]), timeout=30)

    await offered(f"{request_id}-warm", [30], [3])  # the handshake and the streams between the two come first
    before = [await scrape(observed.prefill), await scrape(observed.decode)]
    await offered(request_id, [10, 11], [0, 1])
    after = [await scrape(observed.prefill), await scrape(observed.decode)]

    def messages(side: int, port: str, method: str, direction: str) -> float:
        return delta(before[side], after[side], "kvbroker_grpc_messages_total", port=port, method=method,
                     direction=direction)

    for direction in ("in", "out"):
        assert messages(0, "local", "BrokerService/Transfer", direction) == 1
        assert messages(1, "local", "BrokerService/ExpectTransfer", direction) == 1
        assert messages(0, "peer", "PeerService/NotifyStream", direction) == 1  # the offer
        assert messages(1, "peer", "PeerService/NotifyStream", direction) == 1  # the part's notice


async def test_metrics_count_a_refused_transfer_by_its_code_on_both_sides(observed, engines, request_id):
    src = await engines.make(observed.prefill, "prefill", pp_size=2, pp_rank=0)
    dst = await engines.make(observed.decode, "decode", fill="canary")
    await grant(dst, request_id, range(8))
    before = [await scrape(observed.prefill), await scrape(observed.decode)]
    with pytest.raises(grpc.aio.AioRpcError, match="PP>1"):
        await transfer(src, dst, request_id, range(8))
    await log_lines(observed.decode, request_id)  # the receiver's grant has ended
    after = [await scrape(observed.prefill), await scrape(observed.decode)]
    for b, a, role in zip(before, after, ("sender", "receiver")):
        for name in NAMES.values():
            assert delta(b, a, "kvbroker_transfers_failed_total", role=role, component=name,
                         code="FAILED_PRECONDITION") == 1
            assert delta(b, a, "kvbroker_transfers_succeeded_total", role=role, component=name) == 0
        assert delta(b, a, "kvbroker_transferred_bytes_total", role=role, component="MAIN_KV") == 0
        assert delta(b, a, "kvbroker_transfer_duration_seconds_count", role=role, outcome="failed") == 1


async def test_registered_engine_gauges_drop_when_an_engine_unregisters(observed, engines):
    before = await scrape(observed.decode)
    dst = await engines.make(observed.decode, "decode", fill="canary")
    during = await scrape(observed.decode)
    await dst.stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=dst.engine_id), timeout=30)
    after = await scrape(observed.decode)
    assert delta(before, during, "kvbroker_engines") == 1
    assert delta(before, during, "kvbroker_registered_bytes", component="MAIN_KV") == component_bytes(
        dst, pb.COMPONENT_MAIN_KV, SMALL.num_pages)
    assert delta(before, after, "kvbroker_engines") == 0
    assert delta(before, after, "kvbroker_registered_bytes", component="MAIN_KV") == 0


# -- logs ---------------------------------------------------------------------------------------

async def test_each_request_end_is_one_json_line_on_each_side(observed, engines, request_id):
    src, dst, status = await moved(observed, engines, request_id)
    sent = await log_lines(observed.prefill, request_id)
    received = await log_lines(observed.decode, request_id)
    assert len(sent) == 1 and len(received) == 1, "one line per request end, none per page"
    for line, role, engine, peer in ((sent[0], "sender", src, observed.decode.peer_address),
                                     (received[0], "receiver", dst, observed.prefill.process.broker_id)):
        assert line["msg"] == "transfer succeeded" and line["level"] == "info"
        assert line["logger"] == "kvbroker.transfer"
        assert (line["role"], line["engine_id"], line["peer"]) == (role, engine.engine_id, peer)
        assert line["components"] == ["MAIN_KV", "MINIMAX_INDEX_K"]
        assert (line["pages"], line["runs"], line["bytes"]) == (status.pages, status.runs, status.bytes)
        assert line["outcome"] == "SUCCEEDED" and line["code"] == ""
        assert line["duration_us"] > 0


async def test_an_expired_grant_is_logged_and_counted(observed, engines, request_id):
    dst = await engines.make(observed.decode, "decode", fill="canary")
    before = await scrape(observed.decode)
    await grant(dst, request_id, range(4), components=[pb.COMPONENT_MINIMAX_INDEX_K], expiry_ms=100)
    (line,) = await log_lines(observed.decode, request_id)
    after = await scrape(observed.decode)
    assert line["msg"] == "transfer failed" and line["outcome"] == "FAILED"
    assert line["code"] == "DEADLINE_EXCEEDED" and "grant expired" in line["reason"]
    assert line["peer"] == ""  # never claimed
    assert delta(before, after, "kvbroker_transfers_failed_total", role="receiver", component="MINIMAX_INDEX_K",
                 code="DEADLINE_EXCEEDED") == 1


async def test_log_format_defaults_to_json_when_stderr_is_not_a_terminal(observed):
    serving = [json.loads(line) for line in observed.decode.process.stderr_lines if '"broker serving"' in line]
    assert serving and serving[0]["metrics_listen"] == observed.decode.process.metrics_listen


async def test_log_level_warning_writes_no_transfer_lines(brokers, engines, request_id):
    await moved(brokers, engines, request_id)  # the shared pair runs at --log-level WARNING
    await asyncio.sleep(0.2)
    for broker in (brokers.prefill, brokers.decode):
        assert not [line for line in broker.process.stderr_lines if request_id in line]


# -- kvbroker status ----------------------------------------------------------------------------

async def test_status_prints_engines_peers_and_counters(observed, engines, request_id):
    src, _, _ = await moved(observed, engines, request_id)
    code, out, err = await kvbroker("status", "--address", observed.prefill.process.listen)
    assert code == 0, err
    assert "health        SERVING" in out and "obs-prefill" in out
    assert "peers         NOT authenticated, admitting *" in out  # a plaintext peer port says so
    assert any(line.startswith("WARNING") and "squat" in line and "confused deputy" in line
               for line in out.splitlines())
    engine_row = next(line for line in out.splitlines() if line.startswith(src.engine_id))
    assert "MAIN_KV" in engine_row and "KV_SPLIT" in engine_row
    assert any(line.split()[:1] == ["MINIMAX_INDEX_K"] for line in out.splitlines())
    peer_row = next(line for line in out.splitlines() if line.startswith(observed.decode.peer_address))
    assert "obs-decode" in peer_row
    assert any(line.split()[:1] == ["SUCCEEDED"] and line.split()[1] != "0" for line in out.splitlines())


async def test_status_json_reads_the_listen_setting(observed, engines, request_id):
    src, _, _ = await moved(observed, engines, request_id)
    code, out, err = await kvbroker("status", "--json", env={"KVBROKER_LISTEN": observed.prefill.process.listen})
    assert code == 0, err
    status = json.loads(out)
    assert status["broker_id"] == "obs-prefill" and status["health"] == "SERVING"
    assert status["backend"] == "nixl" and status["peer_address"] == observed.prefill.peer_address
    assert status["peers_authenticated"] is False and status["peer_allow"] == ["*"]
    assert len(status["warnings"]) == 1 and "mutual TLS" in status["warnings"][0]
    (engine,) = [e for e in status["engines"] if e["engine_id"] == src.engine_id]
    assert [c["component"] for c in engine["components"]] == ["MAIN_KV", "MINIMAX_INDEX_K"]
    assert engine["registered_bytes"] == sum(c["bytes"] for c in engine["components"])
    (peer,) = [p for p in status["peers"] if p["address"] == observed.decode.peer_address]
    assert peer["broker_id"] == "obs-decode" and peer["handshakes"] >= 1
    assert status["request_counts"]["SUCCEEDED"] >= 1
    assert list(status["request_counts"])[:4] == ["PENDING", "TRANSFERRING", "SUCCEEDED", "FAILED"]


async def test_status_of_an_unreachable_broker_exits_one():
    code, out, err = await kvbroker("status", "--address", "127.0.0.1:1", "--timeout", "1")
    assert code == 1 and out == ""
    assert "127.0.0.1:1" in err and "UNAVAILABLE" in err


async def test_status_lists_open_sessions_and_the_engines_they_hold(observed, engines):
    broker = observed.decode
    call = broker.stub.OpenSession(bpb.OpenSessionRequest(holder="decode-0 pid 7"))
    try:
        session_id = (await call.read()).session_id
        held = await engines.make(broker, "decode", fill="canary", session_id=session_id)
        code, out, err = await kvbroker("status", "--address", broker.process.listen)
        code_json, out_json, _ = await kvbroker("status", "--json", "--address", broker.process.listen)
    finally:
        call.cancel()
    assert code == code_json == 0, err
    row = next(line for line in out.splitlines() if line.startswith(session_id))
    assert "decode-0 pid 7" in row and held.engine_id in row
    status = json.loads(out_json)
    (session,) = [x for x in status["sessions"] if x["session_id"] == session_id]
    assert session["engine_ids"] == [held.engine_id] and session["opened"].endswith("Z")
    (engine,) = [e for e in status["engines"] if e["engine_id"] == held.engine_id]
    assert (engine["session_id"], engine["memory_ownership"]) == (session_id, "SERVER")
