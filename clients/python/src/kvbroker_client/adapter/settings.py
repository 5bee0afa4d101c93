"""What an adapter reads from its environment, once: `AdapterSettings.from_env()`."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_ADDRESS = "unix:/run/kvbroker/kvbroker.sock"


@dataclass(frozen=True)
class AdapterSettings:
    """The broker an engine's ranks talk to, and the bounds of each call."""

    address: str = DEFAULT_ADDRESS  # KVBROKER_ADDRESS: the broker in this pod (unix:PATH or host:port)
    engine_prefix: str = ""  # KVBROKER_ENGINE_PREFIX: the first part of every engine id
    connect_timeout_s: float = 30.0  # KVBROKER_CONNECT_TIMEOUT_S: startup: connect and register
    call_timeout_s: float = 30.0  # KVBROKER_CALL_TIMEOUT_S: one offer, part or cancel; a sender's offer wait
    grant_expiry_s: float | None = None  # KVBROKER_GRANT_EXPIRY_S: unset: the engine's own wait
    watch_timeout_s: float = 600.0  # one watch; watched again while the request lives
    hold_s: float = 300.0  # KVBROKER_HOLD_S: how long a finished sender holds its pages for the receiver's offer

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AdapterSettings:
        def number(name: str, default):
            value = env.get(name, "")
            return float(value) if value else default

        prefix = env.get("KVBROKER_ENGINE_PREFIX") or f"{socket.gethostname()}-{os.getpid()}"
        return cls(address=env.get("KVBROKER_ADDRESS") or DEFAULT_ADDRESS,
                   engine_prefix=re.sub(r"[^A-Za-z0-9._:-]", "-", prefix)[:64],
                   connect_timeout_s=number("KVBROKER_CONNECT_TIMEOUT_S", cls.connect_timeout_s),
                   call_timeout_s=number("KVBROKER_CALL_TIMEOUT_S", cls.call_timeout_s),
                   grant_expiry_s=number("KVBROKER_GRANT_EXPIRY_S", None),
                   hold_s=number("KVBROKER_HOLD_S", cls.hold_s))
