"""The domain's failures. Each carries the status code the edge reports (numbers as google.rpc.Code).

`BrokerError(code, reason)` is what the domain raises; `invalid`, `not_found` and `precondition`
build the common ones; `engine_failed` is a transfer engine's failure at any call; `peer_code`
reads a peer's code as ours; `clip` bounds a peer's or caller's reason; `code_name` names a code
number for logs. edge/codes.py maps them onto gRPC.
"""

from __future__ import annotations

import enum
import hmac

MAX_REASON = 1024  # characters of a reason kept from a peer or a caller


class Code(enum.IntEnum):
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


def code_name(code: int) -> str:
    """The name of a status code number; a peer may report one this broker has no member for."""
    return Code(code).name if code in Code._value2member_map_ else str(code)


class BrokerError(Exception):
    """A refusal or failure with the code the caller sees and its reason, naming the field or rule
    (`reason`: the proto's word for it, TransferStatus.reason, and the client's BrokerError.reason)."""

    def __init__(self, code: Code, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason

    def __repr__(self) -> str:
        return f"BrokerError({self.code.name}, {self.reason!r})"


def invalid(reason: str) -> BrokerError:
    return BrokerError(Code.INVALID_ARGUMENT, reason)


def not_found(reason: str) -> BrokerError:
    return BrokerError(Code.NOT_FOUND, reason)


def precondition(reason: str) -> BrokerError:
    return BrokerError(Code.FAILED_PRECONDITION, reason)


def engine_failed(backend_name: str, exc: Exception, *, context: str = "") -> BrokerError:
    """A transfer engine's failure, at any call, as the caller sees it: ABORTED, in the engine's words."""
    return BrokerError(Code.ABORTED, f"{context}transfer engine {backend_name}: {exc}")


def peer_code(code: int) -> Code:
    """A peer's failure code as ours: one outside our table (or OK) becomes ABORTED."""
    return Code(code) if code and code in Code._value2member_map_ else Code.ABORTED


def clip(reason: str) -> str:
    """A reason from a peer or a caller, cut to MAX_REASON characters."""
    return reason[:MAX_REASON]


def same_token(a: str, b: str) -> bool:
    """Compare two secrets in constant time."""
    return hmac.compare_digest(a.encode(), b.encode())
