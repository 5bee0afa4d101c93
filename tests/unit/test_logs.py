"""Log format selection: auto is text on a terminal and JSON lines anywhere else."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from kvbroker import logs


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
