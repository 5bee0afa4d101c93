"""Transfer engines behind one small interface. `create_backend` picks one by name, importing lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbroker.backends.base import Backend
    from kvbroker.config import Settings

BACKENDS = ("nixl", "mooncake")


def create_backend(settings: Settings, agent_name: str) -> Backend:
    if settings.backend == "nixl":
        from kvbroker.backends.nixl import NixlBackend

        return NixlBackend(agent_name, settings)
    if settings.backend == "mooncake":
        from kvbroker.backends.mooncake import MooncakeBackend

        return MooncakeBackend(agent_name, settings)
    raise ValueError(f"backend: unknown transfer engine {settings.backend!r}; choose one of {BACKENDS}")
