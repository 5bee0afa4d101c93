"""What both servicers share at the gRPC edge:
- `translate_errors`: wraps a unary servicer method, BrokerError → its status, anything else INTERNAL;
- `status_code`, `details`: a domain code and message as gRPC sends them (streaming handlers; the
  numbers' table is kvbroker_client.codes, the clients' too);
- `failure`: what a unary method's exception becomes, as a code and a message (translate_errors,
  and the Exchange stream's replies: one mapping for both);
What every call meets before a servicer sees it (size, parse, lists, concurrency) is admission.py.
"""

from __future__ import annotations

import functools
import logging

import grpc

from kvbroker.core.errors import BrokerError, Code
from kvbroker_client import codes

log = logging.getLogger(__name__)


def status_code(code: Code | int) -> grpc.StatusCode:
    """A domain code (the same numbers) as gRPC sends it."""
    return codes.status_code(int(code))


MAX_DETAILS_BYTES = 1024


def details(message: str) -> str:
    """A status message short enough for the grpc-message trailer: gRPC percent-encodes it, and a
    client refuses trailers over 8 KiB, which a message echoing a long id would exceed."""
    raw = message.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return message
    return raw[:MAX_DETAILS_BYTES].decode(errors="ignore") + f"... ({len(raw)} bytes, clipped)"


def failure(exc: BaseException, where: str = "a command") -> tuple[grpc.StatusCode, str]:
    """BrokerError → its code and message; anything else → INTERNAL, logged."""
    if isinstance(exc, BrokerError):
        return status_code(exc.code), details(exc.reason)
    log.error("%s failed", where, exc_info=exc)
    return grpc.StatusCode.INTERNAL, details(f"internal error: {type(exc).__name__}: {exc}")


def translate_errors(method):
    """Wrap a unary servicer method: BrokerError → its status; anything else → INTERNAL, logged."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            await context.abort(*failure(exc, method.__name__))

    return wrapper
