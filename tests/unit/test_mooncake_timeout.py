"""Mooncake's own transfer timeout follows the broker's transfer_timeout_s, as the engine reads it."""

from __future__ import annotations

import os

import pytest

from kvbroker.backends import backend_options
from kvbroker.backends.mooncake import (
    QUIESCE_SLACK_S,
    TRANSFER_TIMEOUT_ENV,
    MooncakeBackend,
    engine_timeout_s,
    quiesce_timeout_s,
)
from kvbroker.config import Settings


@pytest.mark.parametrize(("transfer_timeout_s", "seconds"), [(60.0, 60), (12.5, 13), (0.5, 5), (5.0, 5), (600, 600)])
def test_the_engine_timeout_is_the_brokers_transfer_timeout_rounded_up_to_whole_seconds_of_at_least_5(
        transfer_timeout_s, seconds):
    assert engine_timeout_s(transfer_timeout_s, None) == seconds
    assert engine_timeout_s(transfer_timeout_s, "") == seconds  # set but empty: not a choice


@pytest.mark.parametrize(("configured", "seconds"), [("45", 45), (" 45", 45), ("+45", 45), ("7.9", 7), ("2", 5),
                                                     ("-3", 5), ("soon", 5), ("12s", 12)])
def test_an_operators_mc_transfer_timeout_wins_as_the_engine_parses_it(configured, seconds):
    assert engine_timeout_s(60.0, configured) == seconds


def test_quiescing_waits_as_long_as_the_engine_may_keep_a_batch():
    assert quiesce_timeout_s(60, 0) == 60 + QUIESCE_SLACK_S
    assert quiesce_timeout_s(30, 2_000_000_000) == pytest.approx(30 + 2.0 + QUIESCE_SLACK_S)  # 1 ns per byte


class Engine:
    """Stands in for mooncake.engine.TransferEngine: what the environment said when it was constructed."""

    def __init__(self) -> None:
        self.timeout = os.environ.get(TRANSFER_TIMEOUT_ENV)


def test_the_engine_is_constructed_under_the_brokers_timeout_and_the_environment_is_put_back(monkeypatch):
    monkeypatch.delenv(TRANSFER_TIMEOUT_ENV, raising=False)
    backend = MooncakeBackend(backend_options(Settings(transfer_timeout_s=90.2), "unit"))
    try:
        assert backend._construct(Engine).timeout == "91"
        assert TRANSFER_TIMEOUT_ENV not in os.environ
    finally:
        backend._control.shutdown()
        backend._writers.shutdown()


def test_an_operators_mc_transfer_timeout_is_left_alone(monkeypatch):
    monkeypatch.setenv(TRANSFER_TIMEOUT_ENV, "20")
    backend = MooncakeBackend(backend_options(Settings(transfer_timeout_s=90), "unit"))
    try:
        assert backend._construct(Engine).timeout == "20"
        assert backend._engine_timeout == 20
        assert os.environ[TRANSFER_TIMEOUT_ENV] == "20"
    finally:
        backend._control.shutdown()
        backend._writers.shutdown()
