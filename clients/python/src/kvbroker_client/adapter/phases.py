"""The phases of a request as an adapter sees them, and its failure: the broker's code and words.

    Phase        OPEN -> WAITING -> TRANSFERRING -> SUCCEEDED | FAILED; phases only rise, and a
                 terminal phase stays (the first failure wins; a SUCCEEDED request does not fail)
    Failure      (reason, code): code is the broker's grpc.StatusCode, None for a failure the engine
                 or the client named; `failure_of` makes one of a BrokerError or a FAILED status
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from kvbroker_client.errors import BrokerError
from kvbroker_client.model import TransferState, TransferStatus


class Phase(enum.IntEnum):
    OPEN = 0  # the engine knows the request; nothing is asked of the broker yet
    WAITING = 1  # the broker holds it (PENDING): sender, the offer came; receiver, the grant is offered
    TRANSFERRING = 2  # pages are being written (a part landed, or is on its way)
    SUCCEEDED = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self >= Phase.SUCCEEDED


PHASE_OF_STATE = {TransferState.PENDING: Phase.WAITING, TransferState.TRANSFERRING: Phase.TRANSFERRING,
                  TransferState.SUCCEEDED: Phase.SUCCEEDED, TransferState.FAILED: Phase.FAILED}


@dataclass(frozen=True)
class Failure:
    reason: str
    code: grpc.StatusCode | None = None  # the broker's, when the broker said it


def failure_of(error: BrokerError | TransferStatus) -> Failure:
    """A broker error or a FAILED status, as a failure record says it: "kvbroker CODE: reason"."""
    return Failure(f"kvbroker {error.code.name}: {error.reason}", error.code)
