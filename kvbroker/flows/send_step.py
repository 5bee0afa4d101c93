"""The send step both flows share: a job's budget, the write, and how a failure is named.

The claimed flow's Sender (sender.py) and the offered flow's PartSender (part_sender.py) each run a
request (or a part) as a `SendJob`: its budget is the caller's deadline or transfer_timeout_s,
whichever is shorter; `write` moves the bytes through the transfer engine with the engine's
segments checked before and after; `failure` turns whatever ended a job early into the
BrokerError its record fails with. What differs between the flows (the claim, the offer, the
notice) stays in their modules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvbroker.backends.base import Backend, TransferFailed
from kvbroker.core.errors import BrokerError, Code, engine_failed
from kvbroker.core.model import Descriptors
from kvbroker.flows.registry import Engine
from kvbroker.memory.mapping import check_segments

log = logging.getLogger("kvbroker.transfer")


@dataclass
class SendJob:
    """One request or part on its way: the local engine, and the time it has."""

    engine_id: str
    engine: Engine
    budget: float
    caller_bound: bool  # the budget is the caller's deadline (its expiry is DEADLINE_EXCEEDED), not transfer_timeout_s
    deadline: float  # loop time

    @staticmethod
    def budget_for(timeout: float | None, limit: float) -> tuple[float, bool, float]:
        """(budget, caller_bound, deadline) for a caller's `timeout` (None: none) under `limit`."""
        budget = limit if timeout is None else min(timeout, limit)
        return budget, timeout is not None and timeout <= limit, asyncio.get_running_loop().time() + budget

    def left(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def rpc_timeout(self, peer_rpc_timeout_s: float) -> float:
        """A peer call's bound: peer_rpc_timeout_s, or what is left of the budget if less."""
        return min(self.left(), peer_rpc_timeout_s)

    def out_of_time(self, what: str) -> BrokerError:
        """The budget ran out: the caller's deadline (DEADLINE_EXCEEDED) or transfer_timeout_s (UNAVAILABLE)."""
        code = Code.DEADLINE_EXCEEDED if self.caller_bound else Code.UNAVAILABLE
        return BrokerError(code, f"{what} did not complete within {self.budget:.3f}s")


async def write(backend: Backend, job: SendJob, peer_handle: object, descriptors: Descriptors,
                budget: Callable[[], float], start: Callable[[], None]) -> None:
    """`start` (the record goes TRANSFERRING), then the transfer engine moves the bytes within
    `budget()`; the engine's segments are checked before and after (shrunk or poisoned: a shrunk
    source is the cause to report, and one shrunk during the write may have sent zeros). Nothing
    to write: only `start`."""
    if not descriptors.count:
        start()
        return
    check_segments(job.engine.held, job.engine_id)
    start()
    try:
        await backend.write(peer_handle, descriptors, budget())
    except TransferFailed as exc:
        check_segments(job.engine.held, job.engine_id)
        raise engine_failed(backend.name, exc) from exc
    except TimeoutError as exc:  # the caller's deadline, or an engine that stopped making progress
        code = Code.DEADLINE_EXCEEDED if job.caller_bound and job.left() <= 0.01 else Code.ABORTED
        raise BrokerError(code, f"transfer engine {backend.name}: {exc}") from exc
    check_segments(job.engine.held, job.engine_id)


def failure(exc: BaseException, job: SendJob, what: str, request_id: str, cancelled: BrokerError) -> BrokerError:
    """What ended a job early, as the error its record fails with: its budget's end, a refusal or
    failure, its cancellation (`cancelled`), or a bug (INTERNAL, logged: it must end the request,
    not wedge it)."""
    if isinstance(exc, BrokerError):
        return exc
    if isinstance(exc, TimeoutError):
        return job.out_of_time(what)
    if isinstance(exc, asyncio.CancelledError):
        return cancelled
    log.error("%s %s failed unexpectedly", what, request_id, exc_info=exc)
    return BrokerError(Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
