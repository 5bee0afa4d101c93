"""Log format selection: auto is text on a terminal and JSON lines anywhere else."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from kvbroker.ops import logs


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.mark.parametrize("stream, fmt, json_lines", [
    (io.StringIO, "auto", True), (Terminal, "auto", False), (Terminal, "json", True), (io.StringIO, "text", False),
])
def test_auto_format_is_json_unless_stderr_is_a_terminal(root_logging, monkeypatch, stream, fmt, json_lines):
    monkeypatch.setattr(sys, "stderr", stream())
    logs.configure("INFO", fmt)
    logging.getLogger("kvbroker.transfer").info("transfer succeeded", extra={"request_id": "r1", "pages": 3})
    line = sys.stderr.getvalue().strip()
    if json_lines:
        assert json.loads(line) | {"ts": ""} == {"ts": "", "level": "info", "logger": "kvbroker.transfer",
                                               "msg": "transfer succeeded", "request_id": "r1", "pages": 3}
    else:
        assert line.endswith("INFO    kvbroker.transfer: transfer succeeded request_id=r1 pages=3")


def test_log_level_comes_from_the_setting(root_logging, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    logs.configure("warning", "json")
    logging.getLogger("kvbroker.transfer").info("transfer succeeded")
    assert sys.stderr.getvalue() == ""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def throttled(clock: Clock, **options) -> tuple[logs.LogThrottle, list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    logger = logging.getLogger(f"test.throttle.{id(records)}")
    logger.propagate = False
    logger.addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, record: records.append(record)})())
    return logs.LogThrottle(logger, 10.0, clock=clock, **options), records


def test_a_throttle_logs_one_line_per_key_per_interval_and_then_what_it_held_back():
    clock = Clock()
    throttle, records = throttled(clock)
    assert throttle.warning(("malformed", "ipv4:10.0.0.1"), "refused %s", "a")
    for _ in range(5):
        assert not throttle.warning(("malformed", "ipv4:10.0.0.1"), "refused %s", "b")
    assert throttle.warning(("malformed", "ipv4:10.0.0.2"), "refused %s", "c")  # another peer
    assert throttle.warning(("too large", "ipv4:10.0.0.1"), "refused %s", "d")  # another kind
    clock.now += 10.0
    assert throttle.warning(("malformed", "ipv4:10.0.0.1"), "refused %s", "e", extra={"peer": "ipv4:10.0.0.1"})
    assert [r.getMessage() for r in records] == ["refused a", "refused c", "refused d", "refused e"]
    assert records[-1].suppressed == 5 and records[-1].peer == "ipv4:10.0.0.1"
    assert not hasattr(records[0], "suppressed")


def test_a_throttle_remembers_a_bounded_number_of_keys():
    clock = Clock()
    throttle, records = throttled(clock, max_keys=2)
    for key in ("a", "b", "c"):
        throttle.warning(key, key)
    assert throttle.warning("a", "a again")  # forgotten to make room for c: logged at once
    assert not throttle.warning("c", "c again")
    assert len(records) == 4
