"""Typed errors of the client: one class per gRPC status code, all under `BrokerError`.

A refused call (the broker's status) and a failed request (a FAILED TransferStatus seen by
`BrokerClient.wait`) raise the same classes, so `except NotFound` reads the same for both.
`error_for_code`, `from_rpc_error` and `from_status` build them; the client calls them at its edge.
"""

from __future__ import annotations

import grpc

from kvbroker_client.model import TransferStatus


class BrokerError(Exception):
    """A broker refused a call or a request failed. `code` is the grpc.StatusCode, `reason` the broker's words."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, reason: str, *, status: TransferStatus | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status  # the request's final status when raised by wait()

    def __str__(self) -> str:
        return f"{self.code.name}: {self.reason}"


class Cancelled(BrokerError):
    code = grpc.StatusCode.CANCELLED


class Unknown(BrokerError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(BrokerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(BrokerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(BrokerError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(BrokerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(BrokerError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(BrokerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(BrokerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(BrokerError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(BrokerError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(BrokerError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(BrokerError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(BrokerError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(BrokerError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(BrokerError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[BrokerError]] = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists, PermissionDenied,
                ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal, Unavailable,
                DataLoss, Unauthenticated)
}


def error_for_code(code: grpc.StatusCode) -> type[BrokerError]:
    """The class raised for `code`; OK (never raised) maps to Unknown."""
    return _BY_CODE.get(code, Unknown)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> BrokerError:
    return error_for_code(exc.code())(exc.details() or exc.code().name)


def from_status(status: TransferStatus) -> BrokerError:
    """The error a FAILED request stands for, carrying the status."""
    return error_for_code(status.code)(status.reason or status.code.name, status=status)
