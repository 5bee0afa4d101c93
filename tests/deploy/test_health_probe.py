"""`kvbroker.ops.probe`: the HEALTHCHECK's view of a grpc.health.v1 server (here a bare one, no broker)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvbroker.ops import probe

SERVICE = "kvbroker.v1.BrokerService"


@pytest.fixture
def health_server(tmp_path):
    """A health service on a Unix socket, SERVING overall and for SERVICE."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"unix:{tmp_path}/health.sock"
    server.add_insecure_port(address)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    yield address, servicer
    server.stop(None)


def test_serving_server_exits_zero_and_prints_serving(health_server, capsys):
    address, _ = health_server
    assert probe.main(["--address", address, "--service", SERVICE]) == 0
    assert capsys.readouterr().out == "SERVING\n"


def test_not_serving_exits_one(health_server, capsys):
    address, servicer = health_server
    servicer.enter_graceful_shutdown()
    assert probe.main(["--address", address]) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"


def test_unknown_service_exits_one_naming_not_found(health_server, capsys):
    address, _ = health_server
    assert probe.main(["--address", address, "--service", "no.such.Service"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_nothing_listening_exits_one_naming_unavailable(tmp_path, capsys):
    assert probe.main(["--address", f"unix:{tmp_path}/absent.sock", "--timeout", "1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_default_address_is_the_listen_setting(health_server, monkeypatch, capsys):
    address, _ = health_server
    monkeypatch.setenv("KVBROKER_LISTEN", address)
    monkeypatch.delenv("KVBROKER_HEALTH_LISTEN", raising=False)
    assert probe.main([]) == 0
    assert capsys.readouterr().out == "SERVING\n"


def test_default_address_is_the_health_listen_setting_when_set(health_server, monkeypatch, tmp_path, capsys):
    address, _ = health_server
    monkeypatch.setenv("KVBROKER_HEALTH_LISTEN", address)
    monkeypatch.setenv("KVBROKER_LISTEN", f"unix:{tmp_path}/absent.sock")  # would fail: not asked
    assert probe.main([]) == 0
    assert capsys.readouterr().out == "SERVING\n"
