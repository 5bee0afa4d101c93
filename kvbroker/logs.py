"""Logging setup: JSON lines for containers, plain lines for terminals; extras become fields.

`configure` (cli.py) installs `JsonFormatter` or `TextFormatter` on the root logger.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        return text + "".join(f" {k}={v}" for k, v in extras.items() if v not in ("", None, []))


def configure(level: str, fmt: str) -> None:
    """Log to stderr at `level`; `fmt` is json, text, or auto (text on a terminal, json otherwise)."""
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
