"""The Settings the domain reads, as one frozen record built from them (`Limits.from_settings`):
each bound is named as in kvbroker.config.Settings, where its default and its meaning live."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbroker.config import Settings


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_pages_per_request: int
    default_grant_expiry_s: float
    max_grant_expiry_s: float
    transfer_timeout_s: float
    peer_rpc_timeout_s: float
    offer_wait_s: float
    max_offers: int
    max_aux_bytes: int
    max_parts_per_request: int
    max_engines: int

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: float) -> Limits:
        """The Settings' values of these fields; `overrides` replace some (tests)."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)}
        return cls(**(values | overrides))

    @property
    def peer_settle_s(self) -> float:
        """How long a close, cancel or drain waits for what peers still do: two peer calls."""
        return self.peer_rpc_timeout_s * 2
