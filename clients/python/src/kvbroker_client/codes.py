"""Status codes between a number on the wire and grpc.StatusCode: the one table of the daemon and the clients.

kvbroker's messages carry google.rpc.Code numbers (TransferStatus.code, ExchangeError.code,
NotifyStreamResponse.code); gRPC calls end with a grpc.StatusCode. The daemon's domain has its own
enum with the same numbers (kvbroker.core.errors.Code, no grpc below the edge); its edge and every
client convert here, and the clients' error classes (errors.py) are keyed by the grpc.StatusCode.
"""

from __future__ import annotations

import grpc

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Code number; UNKNOWN for a number outside the table."""
    return _BY_NUMBER.get(int(number), grpc.StatusCode.UNKNOWN)


def code_number(code: grpc.StatusCode) -> int:
    """The google.rpc.Code number a message carries for `code`."""
    return code.value[0]
