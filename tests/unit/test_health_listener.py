"""kvbroker.ops.health_listener on a real grpc server in this process: Check per service, the lifecycle
(NOT_SERVING until serving(), for good after draining()), and NOT_SERVING while the loop's heartbeat is
older than stall_s (a clock of the test's own: no waiting)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from kvbroker.config import Settings
from kvbroker.ops.health_listener import HealthListener

SERVICE = "kvbroker.v1.BrokerService"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def listener():
    clock = Clock()
    served = HealthListener((SERVICE,), stall_s=20.0, threads=2, max_calls=64, clock=clock)
    address = served.bind("127.0.0.1:0")
    served.start()
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)

    def check(service: str = "") -> str:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    yield served, clock, check, address
    channel.close()
    served.stop(1.0)


def test_not_serving_until_serving_then_for_good_after_draining(listener):
    served, _, check, _ = listener
    assert (check(), check(SERVICE)) == ("NOT_SERVING", "NOT_SERVING")
    served.serving()
    assert (check(), check(SERVICE)) == ("SERVING", "SERVING")
    served.draining()
    served.serving()  # too late: a drain is for good
    assert (check(), check(SERVICE)) == ("NOT_SERVING", "NOT_SERVING")


def test_a_loop_that_stops_beating_is_reported_not_serving(listener):
    served, clock, check, _ = listener
    served.serving()
    clock.now += 20.0
    assert check(SERVICE) == "SERVING"  # not yet older than stall_s
    clock.now += 0.5
    assert (check(), check(SERVICE)) == ("NOT_SERVING", "NOT_SERVING")
    served.beat()
    assert (check(), check(SERVICE)) == ("SERVING", "SERVING")


def test_unknown_services_are_not_found_and_watch_is_refused_naming_the_local_api(listener):
    served, _, check, address = listener
    served.serving()
    with pytest.raises(grpc.RpcError) as info:
        check("kvbroker.v1.Nothing")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            next(watch)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "local API" in info.value.details()


def test_the_listeners_bounds_are_settings_and_a_stall_must_outlast_a_beat():
    s = Settings(health_beat_s=5.0, health_stall_s=6.0, health_threads=3, health_max_calls=8)
    assert (s.health_beat_s, s.health_stall_s, s.health_threads, s.health_max_calls) == (5.0, 6.0, 3, 8)
    assert (Settings().health_beat_s, Settings().health_stall_s) == (1.0, 20.0)
    with pytest.raises(ValidationError, match="must exceed health_beat_s"):
        Settings(health_beat_s=5.0, health_stall_s=5.0)  # a live loop would read as stalled between beats
