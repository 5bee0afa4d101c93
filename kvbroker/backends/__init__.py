"""Transfer engines behind one small interface (base.py). `create_backend` picks one by name,
importing it lazily, and builds it from the broker's Settings through `backend_options`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbroker.backends.base import BackendOptions

if TYPE_CHECKING:
    from kvbroker.backends.base import Backend
    from kvbroker.config import Settings

BACKENDS = ("nixl", "mooncake")


def backend_options(settings: Settings, agent_name: str) -> BackendOptions:
    """What a backend reads of the settings; `agent_name` names this broker towards its engine."""
    return BackendOptions(agent_name=agent_name, transfer_timeout_s=settings.transfer_timeout_s,
                          advertised_host=settings.advertised_host, mooncake_protocol=settings.mooncake_protocol,
                          mooncake_device=settings.mooncake_device, data_ports=settings.data_ports,
                          nixl_progress_poll_ms=settings.nixl_progress_poll_ms)


def create_backend(settings: Settings, agent_name: str) -> Backend:
    if settings.backend == "nixl":
        from kvbroker.backends.nixl import NixlBackend

        return NixlBackend(backend_options(settings, agent_name))
    if settings.backend == "mooncake":
        from kvbroker.backends.mooncake import MooncakeBackend

        return MooncakeBackend(backend_options(settings, agent_name))
    raise ValueError(f"backend: unknown transfer engine {settings.backend!r}; choose one of {BACKENDS}")
