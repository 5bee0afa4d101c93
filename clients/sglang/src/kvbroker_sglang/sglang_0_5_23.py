"""Every use of SGLang's private surface, read from SGLang 0.5.23 (sglang/srt/disaggregation/common/conn.py).

The plugin refuses any other SGLang at load (plugin.check_version); moving to another release means
reading these against it, here, and nowhere else.

Overridden (private methods whose upstream code the adapter extends; the mixins below):
    CommonKVManager._register_topology_row        prefill's /route row also names its broker
    CommonKVReceiver._send_abort_notification     decode's abort frames, then the grant cancelled
    CommonKVBootstrapServer._handle_route_put/_handle_route_get   the /route rows carry the broker
Used (private attributes and methods, through the functions below):
    CommonKVReceiver._connect_to_bootstrap_server, ._abort_generation
    CommonKVManager._send_multipart_locked, ._start_heartbeat_checker_thread, ._heartbeat_shutdown,
        ._socket_cache, ._monitor_cache, ._socket_lock
    CommonKVSender._transfer_metric, ._transfer_start_time
    CommonKVBootstrapServer._loop, ._background_tasks
Public hooks the adapter overrides: update_status, add_transfer_request,
build_receiver_registration_message, build_receiver_metadata_message, poll, poll_pp_consensus,
abort, clear, failure_exception, get_transfer_metric, send_metadata. Public state it reads or
calls: request_status, failure_records, failure_lock, transfer_infos, req_to_decode_prefix_len,
decode_kv_args_table, waiting_timeout, note_abort_ack, check_peer_aux_buffer_count, check_status.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what each mixin is mixed into (SGLang is untyped: Any to mypy)
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer as _BootstrapServer
    from sglang.srt.disaggregation.common.conn import CommonKVManager as _Manager
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver as _Receiver
    from sglang.srt.disaggregation.common.conn import CommonKVSender as _Sender
else:
    _BootstrapServer = _Manager = _Receiver = _Sender = object

VERSION = "0.5.23"


class ManagerSurface(_Manager):
    """Mixed into the KV managers before CommonKVManager."""

    def route_row(self, payload: dict) -> dict:
        """Prefill: the /route row this rank PUTs (the base row unless a role adds to it)."""
        return payload

    def _register_topology_row(self, url: str, payload: dict) -> None:
        super()._register_topology_row(url, self.route_row(payload))

    def send_frames(self, address, frames: list[bytes]) -> None:
        """Push frames to another rank's control socket (SGLang's cached PUSH sockets)."""
        self._send_multipart_locked(address.to_tcp(), frames, address.is_ipv6)

    def start_heartbeat(self) -> threading.Thread:
        """Decode: SGLang's heartbeat checker of the prefill bootstrap servers."""
        return self._start_heartbeat_checker_thread()

    def stop_heartbeat(self) -> None:
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()

    def close_cached_sockets(self) -> list:
        """Take the PUSH sockets (and monitors) SGLang cached; an open one would block the ZMQ
        context's term() when the manager is collected. Returns them, to be closed."""
        with getattr(self, "_socket_lock", threading.Lock()):
            cached = [*getattr(self, "_socket_cache", {}).values(), *getattr(self, "_monitor_cache", {}).values()]
            for table in ("_socket_cache", "_monitor_cache"):
                getattr(self, table, {}).clear()
        return cached


class ReceiverSurface(_Receiver):
    """Mixed into the KV receiver before CommonKVReceiver."""

    def after_abort_frames(self, generation) -> None:
        """Decode: SGLang sent its abort frames (and armed its deferred release as `generation`)."""

    def _send_abort_notification(self, *, force_arm: bool = False):
        super()._send_abort_notification(force_arm=force_arm)
        self.after_abort_frames(self._abort_generation)

    def push_to_prefill(self, info: dict, frames: list[bytes]) -> None:
        """A frame to the prefill rank `info` names, on SGLang's socket to it."""
        sock, lock = self._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart(frames)


class SenderSurface(_Sender):
    """Mixed into the KV sender before CommonKVSender."""

    def record_transfer_metric(self, total_bytes: int, succeeded_at: float | None) -> None:
        """What the broker moved, and how long it took from SGLang's first send() (kept by SGLang)."""
        if self._transfer_metric.transfer_total_bytes is not None:
            return
        self._transfer_metric.transfer_total_bytes = int(total_bytes)
        if self._transfer_start_time is not None and succeeded_at is not None:
            self._transfer_metric.transfer_latency_s = max(0.0, succeeded_at - self._transfer_start_time)

    def transfer_metric(self):
        """SGLang's metric record, or None before the broker's bytes are in it."""
        return self._transfer_metric if self._transfer_metric.transfer_total_bytes is not None else None


class BootstrapSurface(_BootstrapServer):
    """Mixed into the bootstrap server before CommonKVBootstrapServer."""

    async def route_put(self, data: dict, response):
        """The /route PUT, after SGLang's own handling; returns the response."""
        return response

    async def route_get(self, request, response):
        """The /route GET, after SGLang's own handling; returns the response."""
        return response

    async def _handle_route_put(self, request):
        data = await request.json()
        return await self.route_put(data, await super()._handle_route_put(request))

    async def _handle_route_get(self, request):
        return await self.route_get(request, await super()._handle_route_get(request))

    def cancel_background_tasks(self) -> None:
        """End the server's own cleanup tasks (upstream leaves them pending at close)."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            for task in list(self._background_tasks):
                loop.call_soon_threadsafe(task.cancel)
