"""Logging setup: JSON lines for containers, plain lines for terminals; extras become fields.

`configure` (cli.py) installs `JsonFormatter` or `TextFormatter` on the root logger.
`LogThrottle` keeps lines about repeated bad input (admission.py's refusals) to one per kind and
peer per interval, with the count of those it held back.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

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


class LogThrottle:
    """One line per key per `interval_s`: `warning` logs the first line of a key, holds back the
    others for the interval and counts them; the next line logged for the key says how many it
    held back (field `suppressed`). At most `max_keys` keys are remembered, the least recently
    logged forgotten first, so a flood from many peers costs bounded memory (and may log more)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, *, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[Hashable, list] = OrderedDict()  # key -> [when last logged, held back since]

    def warning(self, key: Hashable, msg: str, *args: object, extra: dict | None = None) -> bool:
        """Log `msg % args` at WARNING unless `key` logged within the interval; True when it logged."""
        now = self._clock()
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self._interval_s:
            entry[1] += 1
            return False
        suppressed = entry[1] if entry is not None else 0
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        fields = dict(extra or {})
        if suppressed:
            fields["suppressed"] = suppressed
        self._logger.warning(msg, *args, extra=fields)
        return True
