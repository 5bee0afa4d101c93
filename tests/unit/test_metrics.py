"""Metrics as the TransferTable and the Registry feed them, and the endpoint's lifecycle."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbroker.core.errors import Code
from kvbroker.core.model import BufferLayout, BufferRole, Component, ComponentLayout, Layout
from kvbroker.flows.transfers import TransferTable
from kvbroker.ops.metrics import Metrics, split_address

MAIN_KV, INDEX_K = Component.MAIN_KV, Component.MINIMAX_INDEX_K


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def engine(engine_id: str = "prefill-0/tp0"):
    """An engine as the metrics see it: 2 layers of K and V (item_len 64), 2 index buffers (item_len 16)."""
    main = tuple(BufferLayout(layer, role, 0, 64 * 100, 64)
                 for layer in (0, 1) for role in (BufferRole.K, BufferRole.V))
    index = tuple(BufferLayout(layer, BufferRole.FLAT, 0, 16 * 100, 16) for layer in (0, 1))
    components = {MAIN_KV: ComponentLayout(MAIN_KV, Layout.KV_SPLIT, 100, main),
                  INDEX_K: ComponentLayout(INDEX_K, Layout.FLAT, 100, index)}
    return SimpleNamespace(engine_id=engine_id, layout=SimpleNamespace(components=components))


def value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def observed():
    metrics, clock = Metrics(), Clock()
    return metrics, clock, TransferTable(clock=clock, observer=metrics)


def test_a_succeeded_send_counts_per_component_with_its_bytes(observed):
    metrics, clock, table = observed
    metrics.engine_added(engine())
    record = table.add_send("prefill-0/tp0", "r1", (MAIN_KV, INDEX_K), receiver_address="decode:50052")
    clock.now += 0.25
    table.start(record)
    clock.now += 0.5
    table.succeed(record, pages=10, runs=3, nbytes=10 * (4 * 64 + 2 * 16), truncated=2)

    for kind in ("MAIN_KV", "MINIMAX_INDEX_K"):
        assert value(metrics, "kvbroker_transfers_started_total", role="sender", component=kind) == 1
        assert value(metrics, "kvbroker_transfers_succeeded_total", role="sender", component=kind) == 1
    assert value(metrics, "kvbroker_transferred_bytes_total", role="sender", component="MAIN_KV") == 10 * 4 * 64
    assert value(metrics, "kvbroker_transferred_bytes_total", role="sender", component="MINIMAX_INDEX_K") == 320
    assert value(metrics, "kvbroker_transferred_pages_total", role="sender") == 10
    assert value(metrics, "kvbroker_transferred_runs_total", role="sender") == 3
    assert value(metrics, "kvbroker_truncated_pages_total", role="sender") == 2
    assert value(metrics, "kvbroker_transfer_queue_wait_seconds_sum", role="sender") == pytest.approx(0.25)
    assert value(metrics, "kvbroker_transfer_duration_seconds_sum", role="sender",
                 outcome="succeeded") == pytest.approx(0.75)
    assert value(metrics, "kvbroker_transfer_duration_seconds_count", role="sender", outcome="succeeded") == 1


def test_an_expired_grant_counts_as_failed_with_its_code(observed):
    metrics, clock, table = observed
    record = table.add_send("decode-0/tp0", "r2", (INDEX_K,))
    table.fail(record, Code.DEADLINE_EXCEEDED, "grant expired")
    assert value(metrics, "kvbroker_transfers_failed_total", role="sender", component="MINIMAX_INDEX_K",
                 code="DEADLINE_EXCEEDED") == 1
    assert value(metrics, "kvbroker_transfers_succeeded_total", role="sender", component="MINIMAX_INDEX_K") == 0
    assert value(metrics, "kvbroker_transfer_queue_wait_seconds_count", role="sender") == 0
    assert value(metrics, "kvbroker_transfer_duration_seconds_count", role="sender", outcome="failed") == 1


def test_a_code_a_peer_reports_without_a_name_is_counted_by_number(observed):
    metrics, _, table = observed
    table.fail(table.add_send("e", "r3", (MAIN_KV,)), 2, "the peer's UNKNOWN")
    assert value(metrics, "kvbroker_transfers_failed_total", role="sender", component="MAIN_KV", code="2") == 1


def test_a_record_ends_once_in_the_metrics(observed):
    metrics, _, table = observed
    record = table.add_send("e", "r4", (MAIN_KV,))
    table.fail(record, Code.CANCELLED, "cancelled")
    table.fail(record, Code.ABORTED, "late")
    table.succeed(record, pages=1, runs=1, nbytes=1, truncated=0)
    assert value(metrics, "kvbroker_transfers_failed_total", role="sender", component="MAIN_KV",
                 code="CANCELLED") == 1
    assert value(metrics, "kvbroker_transfer_duration_seconds_count", role="sender", outcome="failed") == 1
    assert value(metrics, "kvbroker_transfers_succeeded_total", role="sender", component="MAIN_KV") == 0


def test_registered_engines_and_bytes_follow_the_registry():
    metrics = Metrics()
    metrics.engine_added(engine("a"))
    metrics.engine_added(engine("b"))
    assert value(metrics, "kvbroker_engines") == 2
    assert value(metrics, "kvbroker_registered_bytes", component="MAIN_KV") == 2 * 4 * 6400
    metrics.engine_removed(engine("a"))
    assert value(metrics, "kvbroker_engines") == 1
    assert value(metrics, "kvbroker_registered_bytes", component="MINIMAX_INDEX_K") == 2 * 1600


def test_handshakes_and_epoch_changes_are_counted():
    metrics = Metrics()
    metrics.peer_handshake(epoch_changed=False)
    metrics.peer_handshake(epoch_changed=True)
    assert value(metrics, "kvbroker_peer_handshakes_total") == 2
    assert value(metrics, "kvbroker_peer_epoch_changes_total") == 1


def test_notify_calls_and_the_part_notices_they_carry_are_counted():
    metrics = Metrics()
    metrics.peer_notify(1)
    metrics.peer_notify(5)
    assert value(metrics, "kvbroker_peer_notify_calls_total") == 2
    assert value(metrics, "kvbroker_peer_part_notices_total") == 6


def test_two_brokers_in_one_process_keep_separate_metrics():
    first, second = Metrics(), Metrics()
    first.peer_handshake(epoch_changed=False)
    assert value(second, "kvbroker_peer_handshakes_total") == 0


async def test_the_endpoint_serves_on_the_address_given_and_stops():
    metrics = Metrics()
    metrics.peer_handshake(epoch_changed=False)
    bound = metrics.serve("127.0.0.1:0")
    host, port = split_address(bound)
    assert host == "127.0.0.1" and port > 0
    def scrape() -> str:
        with urllib.request.urlopen(f"http://{bound}/metrics", timeout=5) as reply:
            return reply.read().decode()

    assert "kvbroker_peer_handshakes_total 1.0" in await asyncio.to_thread(scrape)
    await metrics.close()
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape)


@pytest.mark.parametrize("address", ["9400", ":9400", "localhost:", "localhost:http", "[::1]:70000"])
def test_metrics_listen_must_name_host_and_port(address):
    with pytest.raises(ValueError, match="is not host:port"):
        split_address(address)


def test_metrics_listen_takes_ipv6_in_brackets():
    assert split_address("[::1]:9400") == ("::1", 9400)


def test_every_metric_is_in_the_readme_with_its_labels(observed):
    metrics, _, table = observed
    record = table.add_send("e", "r5", (MAIN_KV,))  # so that every labelled metric has a sample
    table.start(record)
    table.fail(record, Code.ABORTED, "aborted")
    metrics.messages.key("local", "/kvbroker.v1.BrokerService/Exchange", "in")  # as Admission keys each method
    served = {}
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        served[name] = {k for sample in family.samples for k in sample.labels} - {"le"}
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = re.search(r"^### Metrics\n(.*?)(?=^##+ |\Z)", readme, re.M | re.S).group(1)
    documented = {}
    for row in re.findall(r"^\| `(kvbroker_\w+)` \| \w+ \|([^|]*)\|", section, re.M):
        documented[row[0]] = {label.strip() for label in row[1].split(",") if label.strip()}
    assert documented == served
